"""What the tests that train tiny models of other architectures share (the mixed-island
e2e tests: tests/e2e/test_mixed_archs.py, tests/e2e/test_moe_islands.py)."""

import json
import shutil

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def model_with_tokenizer(arch: str, tiny_llama, dest):
    """A tiny random `arch` model sized to the fixture tokenizer (copied beside it)."""
    from yeto.testing.archs import tiny_model

    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    tiny_model(arch, dest, seed=0, overrides={"vocab_size": vocab, "pad_token_id": 0,
                                              "bos_token_id": 1, "eos_token_id": 2})
    for name in TOKENIZER_FILES:
        shutil.copy(tiny_llama / name, dest / name)
    return dest
