"""The tiny model, tokenizer and task built locally for the tests and `yeto demo`
(yeto.testing). Here: the checks through in-process servers, training or the sim (the
others: tests/unit/test_fixtures.py)."""

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from yeto.data import encode_row, pack_blocks
from yeto.testing import shapes, tiny
from yeto.testing.tasks import task_rows
from yeto.testing.tiny import SIZES, make_tiny_model

PROMPT = [{"role": "user", "content": "reverse: apple river stone"}]


@pytest.fixture(scope="session")
def cache():
    # the shared cache: the pretrained base is built once per machine, not per test run
    return tiny.cache_root().parent


@pytest.fixture(scope="session")
def tiny_model(cache, tmp_path_factory):
    """The pretrained llama fixture, built once per test session."""
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", cache_dir=cache)


def test_model_dir_loads_offline(tiny_model):
    names = sorted(p.name for p in tiny_model.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["num_attention_heads"] == 4
    assert config["tie_word_embeddings"] is False and config["dtype"] == "float32"
    assert config["max_position_embeddings"] >= 512
    model = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    assert model.config.vocab_size == len(tok) == SIZES["vocab_size"]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > ids.shape[1]


def test_cached_call_copies_identical_files(tiny_model, cache, tmp_path, monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("the cached model was rebuilt")

    monkeypatch.setattr(tiny, "_build", no_build)
    again = make_tiny_model(tmp_path / "again", "llama", cache_dir=cache)
    for f in tiny_model.iterdir():
        assert (again / f.name).read_bytes() == f.read_bytes(), f.name
    assert not list(cache.glob("tiny-models/.tmp-*"))


def task_loss(model, tokenizer, rows, seq_len: int = 128) -> float:
    """Token-weighted mean cross-entropy of a torch causal LM on ``rows``."""
    blocks = pack_blocks([encode_row(r, tokenizer) for r in rows], seq_len, tokenizer.pad_token_id)
    total, count = 0.0, 0.0
    with torch.no_grad():
        for i in range(0, len(blocks), 32):
            tokens = torch.from_numpy(blocks.tokens[i : i + 32]).long()
            w = torch.from_numpy(blocks.weights[i : i + 32])
            logits = model(tokens[:, :-1]).logits.float()
            ce = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), tokens[:, 1:], reduction="none"
            )
            total += float((ce * w).sum())
            count += float(w.sum())
    return total / max(count, 1.0)


def test_pretrained_base_knows_format_not_task(tiny_model, cache, tmp_path):
    """The base is far better than random on the task, but leaves LoRA room to learn."""
    _, held_out = task_rows(n_train=10, n_eval=100, seed=0)
    random_dir = make_tiny_model(tmp_path / "r", "llama", pretrain=False, cache_dir=cache)
    losses = {}
    for name, d in (("random", random_dir), ("base", tiny_model)):
        model = AutoModelForCausalLM.from_pretrained(d, local_files_only=True)
        losses[name] = task_loss(model, AutoTokenizer.from_pretrained(d), held_out)
    assert losses["random"] > 6.0
    assert 1.5 < losses["base"] < losses["random"] - 3.0, losses


@pytest.mark.mlx
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_mlx_lm_loads_with_matching_logits(arch, tiny_model, cache, tmp_path):
    mx = pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    if arch == "llama":
        model_dir = tiny_model  # pretrained: realistic logits, not near-uniform
    else:
        model_dir = make_tiny_model(tmp_path / arch, arch, pretrain=False, cache_dir=cache)
    mlx_model, mlx_tok = mlx_lm.load(str(model_dir))
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    ids = tok(ids + "stone river apple<|im_end|>")["input_ids"]
    assert mlx_tok.encode(tok.decode(ids), add_special_tokens=False) == ids
    assert tok.convert_tokens_to_ids("<|im_end|>") in mlx_tok.eos_token_ids

    mlx_logits = np.array(mlx_model(mx.array([ids])).astype(mx.float32))
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    with torch.no_grad():
        torch_logits = model(torch.tensor([ids])).logits.numpy()
    assert mlx_logits.shape == torch_logits.shape
    assert np.abs(mlx_logits - torch_logits).max() < 1e-4


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return shapes.make_shaped_model(tmp_path_factory.mktemp("smollm2"), "smollm2-135m", seed=0)


def test_smollm2_weights_load_in_transformers(smollm2):
    from safetensors import safe_open

    model, info = AutoModelForCausalLM.from_pretrained(
        smollm2, local_files_only=True, output_loading_info=True)
    assert not any(info.values()), info
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == shapes.SHAPES["smollm2-135m"].params
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert torch.equal(model.model.norm.weight, torch.ones(576))
    ids = AutoTokenizer.from_pretrained(smollm2)("def f(x): return x")["input_ids"]
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([ids])).logits).all()

    # the streamed file: float32, lm_head not stored, blocks seeded by (seed, name)
    name = "model.embed_tokens.weight"
    with safe_open(smollm2 / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys() and len(f.keys()) == 272
        stored = f.get_tensor(name)
    std = shapes.SHAPES["smollm2-135m"].config["initializer_range"]
    again = torch.cat(list(shapes._init_chunks(name, stored.to("meta"), 0, std)))
    assert torch.equal(stored, again) and abs(float(stored.std()) - std) < 1e-3


@pytest.mark.mlx
def test_smollm2_loads_in_mlx_with_matching_logits(smollm2):
    mx = pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from yeto.mlx.load import load_model

    mlx_model, _ = load_model(smollm2)
    ids = AutoTokenizer.from_pretrained(smollm2)("def f(x): return x")["input_ids"]
    mlx_logits = np.array(mlx_model(mx.array([ids])).astype(mx.float32))
    model = AutoModelForCausalLM.from_pretrained(smollm2, local_files_only=True)
    with torch.no_grad():
        torch_logits = model(torch.tensor([ids])).logits.numpy()
    assert np.abs(mlx_logits - torch_logits).max() <= 1e-4 * np.abs(torch_logits).max()
