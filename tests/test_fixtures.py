import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from yeto.cli.make import main_make_task, main_make_tiny_model
from yeto.data import encode_row, load_rows, pack_blocks
from yeto.testing import shapes, tiny
from yeto.testing.tasks import make_task, task_rows
from yeto.testing.tiny import SIZES, make_tiny_model
from yeto.testing.tokenizer import CHAT_TEMPLATE, save_tokenizer, stdlib_text, train_tokenizer

PROMPT = [{"role": "user", "content": "reverse: apple river stone"}]


@pytest.fixture(scope="session")
def cache():
    # the shared cache: the pretrained base is built once per machine, not per test run
    return tiny.cache_root().parent


@pytest.fixture(scope="session")
def tiny_model(cache, tmp_path_factory):
    """The pretrained llama fixture, built once per test session."""
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", cache_dir=cache)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_chat_template(tmp_path):
    tok = train_tokenizer([stdlib_text(50_000), "reverse: apple river\n" * 50], vocab_size=400)
    assert len(tok) == 400
    text = "def f(x):\n    return x + 1  # ünïcode ✓"
    assert tok.decode(tok(text)["input_ids"]) == text
    for special in ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"):
        assert len(tok(special)["input_ids"]) == 1
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    rendered = tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>user\nreverse: apple river stone<|im_end|>\n<|im_start|>assistant\n"
    )

    save_tokenizer(tok, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    again = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert again(text)["input_ids"] == tok(text)["input_ids"]
    assert again.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True) == rendered
    assert again.eos_token_id == tok.eos_token_id and again.pad_token_id == tok.pad_token_id


# ---------------------------------------------------------------- task


def test_task_split_is_disjoint_and_deterministic(tmp_path):
    train_path, eval_path = make_task(tmp_path / "a", n_train=300, n_eval=50, seed=3)
    train, held_out = load_rows(train_path), load_rows(eval_path)
    assert (len(train), len(held_out)) == (300, 50)
    prompts = [r["messages"][0]["content"] for r in train]
    held_out_prompts = {r["messages"][0]["content"] for r in held_out}
    assert len(set(prompts)) == 300 and not held_out_prompts & set(prompts)
    for row in train[:20]:
        user, assistant = (m["content"] for m in row["messages"])
        assert user.startswith("reverse: ")
        assert assistant.split() == user.removeprefix("reverse: ").split()[::-1]

    make_task(tmp_path / "b", n_train=300, n_eval=50, seed=3)
    make_task(tmp_path / "c", n_train=300, n_eval=50, seed=4)
    assert (tmp_path / "b" / "train.jsonl").read_bytes() == train_path.read_bytes()
    assert (tmp_path / "c" / "train.jsonl").read_bytes() != train_path.read_bytes()


# ---------------------------------------------------------------- model


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


def test_same_args_build_same_weights(tmp_path):
    a = make_tiny_model(tmp_path / "a", "qwen2", pretrain=False, cache_dir=tmp_path / "c1")
    b = make_tiny_model(tmp_path / "b", "qwen2", pretrain=False, cache_dir=tmp_path / "c2")
    for f in a.iterdir():
        assert (b / f.name).read_bytes() == f.read_bytes(), f.name


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


def test_unknown_arch():
    with pytest.raises(ValueError, match="choose one of llama, qwen2, qwen3"):
        make_tiny_model("unused", arch="gpt9")


def test_cli_entry_points(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        main_make_tiny_model(["--help"])
    assert e.value.code == 0 and "--no-pretrain" in capsys.readouterr().out
    assert main_make_task([str(tmp_path / "t"), "--n-train", "20", "--n-eval", "5"]) == 0
    assert len(load_rows(tmp_path / "t" / "eval.jsonl")) == 5
    monkeypatch.setenv("YETO_CACHE", str(tmp_path / "cache"))
    assert main_make_tiny_model([str(tmp_path / "m"), "--arch", "qwen3", "--no-pretrain"]) == 0
    assert "wrote tiny qwen3 model" in capsys.readouterr().out
    assert (tmp_path / "cache" / "tiny-models").is_dir()
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "m").config.model_type == "qwen3"


# ---------------------------------------------------------------- mlx-lm


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


# ---------------------------------------------------------------- real-shape presets

# The published configurations, written out here independently of shapes.SHAPES.
PUBLISHED = {
    "lfm2.5-230m": dict(model_type="lfm2", hidden_size=1024, num_hidden_layers=14,
                        num_attention_heads=16, num_key_value_heads=8, vocab_size=65536,
                        max_position_embeddings=128000, norm_eps=1e-5, conv_L_cache=3,
                        full_attn_idxs=[2, 4, 6, 8, 10, 12]),
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       intermediate_size=3072, vocab_size=151936, rms_norm_eps=1e-6,
                       max_position_embeddings=40960),
    "llama3.2-1b": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                        intermediate_size=8192, vocab_size=128256, rms_norm_eps=1e-5,
                        max_position_embeddings=131072),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         intermediate_size=1536, vocab_size=49152, rms_norm_eps=1e-5,
                         max_position_embeddings=8192),
}
ROPE = {
    "lfm2.5-230m": {"rope_type": "default", "rope_theta": 1e6},
    "qwen3-0.6b": {"rope_type": "default", "rope_theta": 1e6},
    "llama3.2-1b": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192},
    "smollm2-135m": {"rope_type": "default", "rope_theta": 100000.0},
}
PUBLISHED_PARAMS = {"lfm2.5-230m": 230e6, "qwen3-0.6b": 0.6e9, "llama3.2-1b": 1.23e9,
                    "smollm2-135m": 135e6}


def test_presets_cover_the_published_list():
    assert set(shapes.SHAPES) == set(PUBLISHED)


@pytest.mark.parametrize("shape", list(PUBLISHED))
def test_shape_config_matches_published(shape, tmp_path):
    from transformers import AutoConfig

    out = shapes.make_shaped_model(tmp_path, shape, config_only=True)
    assert not (out / "model.safetensors").exists()
    raw = json.loads((out / "config.json").read_text())
    for key, value in PUBLISHED[shape].items():
        assert raw[key] == value, key
    assert raw["rope_parameters"] == ROPE[shape]
    assert raw["tie_word_embeddings"] is True and raw["dtype"] == "float32"

    # the model transformers builds from it: parameter count on the meta device
    model = shapes.meta_model(AutoConfig.from_pretrained(out))
    n = shapes.count_params(model)
    assert n == shapes.SHAPES[shape].params
    assert abs(n / PUBLISHED_PARAMS[shape] - 1) < 0.03, n
    assert model.lm_head.weight is model.model.embed_tokens.weight
    linears = [p for p, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and ".layers." in p]
    if shape == "lfm2.5-230m":
        assert raw["layer_types"].count("full_attention") == 6
        assert raw["layer_types"].count("conv") == 8
        assert model.model.layers[0].feed_forward.w1.weight.shape == (2560, 1024)
        assert model.model.layers[0].conv.conv.weight.shape[-1] == 3  # L_cache
        assert len(linears) * 2 == 164  # LoRA A + B on every block linear

    # the tokenizer is smaller than the model's vocab; every id it gives is inside it
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert len(tok) <= raw["vocab_size"]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert raw[key] == getattr(tok, key) < len(tok)
    assert tok.model_max_length == raw["max_position_embeddings"]
    generation = json.loads((out / "generation_config.json").read_text())
    assert max(generation["eos_token_id"]) < len(tok)


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
    from yeto.mlx.shims import load_model

    mlx_model, _ = load_model(smollm2)
    ids = AutoTokenizer.from_pretrained(smollm2)("def f(x): return x")["input_ids"]
    mlx_logits = np.array(mlx_model(mx.array([ids])).astype(mx.float32))
    model = AutoModelForCausalLM.from_pretrained(smollm2, local_files_only=True)
    with torch.no_grad():
        torch_logits = model(torch.tensor([ids])).logits.numpy()
    assert np.abs(mlx_logits - torch_logits).max() <= 1e-4 * np.abs(torch_logits).max()


def test_shape_cli(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main_make_tiny_model(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for name, shape in shapes.SHAPES.items():
        assert name in out and f"{shape.params / 1e6:.1f}M" in out
    with pytest.raises(SystemExit):
        main_make_tiny_model([str(tmp_path / "x"), "--shape", "qwen3-0.6b", "--arch", "llama"])
    assert "drop --arch" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main_make_tiny_model([str(tmp_path / "x"), "--config-only"])
    assert "needs --shape" in capsys.readouterr().err
    assert main_make_tiny_model([str(tmp_path / "q"), "--shape", "qwen3-0.6b",
                                 "--config-only"]) == 0
    assert "596,049,920 parameters" in capsys.readouterr().out
    with pytest.raises(ValueError, match="choose one of lfm2.5-230m"):
        shapes.make_shaped_model(tmp_path / "y", "gpt9")
