"""The tiny model, tokenizer and task built locally for the tests and `yeto demo`
(yeto.testing). Here: the checks that need no process, server or training (the others:
tests/integration/test_fixtures.py)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from yeto.cli.make import main_make_task, main_make_tiny_model
from yeto.data import load_rows
from yeto.testing import shapes
from yeto.testing.tasks import make_task
from yeto.testing.tiny import make_tiny_model
from yeto.testing.tokenizer import CHAT_TEMPLATE, save_tokenizer, stdlib_text, train_tokenizer

PROMPT = [{"role": "user", "content": "reverse: apple river stone"}]


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


def test_same_args_build_same_weights(tmp_path):
    a = make_tiny_model(tmp_path / "a", "qwen2", pretrain=False, cache_dir=tmp_path / "c1")
    b = make_tiny_model(tmp_path / "b", "qwen2", pretrain=False, cache_dir=tmp_path / "c2")
    for f in a.iterdir():
        assert (b / f.name).read_bytes() == f.read_bytes(), f.name


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
