"""Document packing falls back to naive for models that mix tokens outside softmax
attention: their conv/state-space/recurrent/linear-attention layers carry one packed
document into the next where no mask reaches (measured on the torch island: a packed
qwen3_next document's logits off its logits alone by 0.10 at max |logit| ~0.6)."""

import json

import pytest

from yeto.loop import mixes_outside_attention, packing_for
from yeto.testing import archs


@pytest.mark.parametrize("arch,mixes", [
    ("llama", False), ("gemma3_text", False), ("llama4", False),  # attention kinds only
    ("lfm2", True), ("mamba2", True), ("qwen3_next", True),
    ("qwen3_5", True),          # linear_attention layers, listed in its text_config
    ("recurrent_gemma", True),  # block_types: recurrent
])
def test_which_models_mix_tokens_outside_attention(arch, mixes):
    assert mixes_outside_attention(archs.tiny_config(arch).to_dict()) is mixes


def test_document_packing_falls_back_to_naive_and_says_so(tmp_path, caplog):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(archs.tiny_config("qwen3_5").to_dict(), default=str))
    assert packing_for("document", path) == "naive"
    assert "--packing naive" in caplog.text
    assert packing_for("naive", path) == "naive"
    path.write_text(json.dumps(archs.tiny_config("llama").to_dict(), default=str))
    assert packing_for("document", path) == "document"
