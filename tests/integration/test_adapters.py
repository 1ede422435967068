"""peft <-> mlx-lm adapter conversion (numpy only; no mlx needed).

Here: the checks through in-process servers, training or the sim (the others:
tests/unit/test_adapters.py, tests/e2e/test_adapters.py)."""


import json
from pathlib import Path

import numpy as np
import pytest
from helpers.adapters import make_peft
from safetensors.numpy import load_file, save_file

from yeto.interop.adapters import (
    MLX_CONFIG,
    MLX_WEIGHTS,
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    AdapterConversionError,
    mlx_to_peft,
    peft_adapter_config,
    peft_to_mlx,
)


@pytest.fixture
def base(tmp_path) -> Path:
    d = tmp_path / "base"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 3}))
    return d


def test_mlx_lm_trained_adapter_to_peft(tmp_path, base):
    """An adapter written by mlx-lm itself (no kept peft config, keys may be null)."""
    d = tmp_path / "mlxlm"
    d.mkdir()
    rng = np.random.default_rng(0)
    w = {}
    for i in (1, 2):
        w[f"model.layers.{i}.self_attn.q_proj.lora_a"] = rng.standard_normal((128, 8), np.float32)
        w[f"model.layers.{i}.self_attn.q_proj.lora_b"] = rng.standard_normal((8, 128), np.float32)
    save_file(w, str(d / MLX_WEIGHTS))
    (d / MLX_CONFIG).write_text(json.dumps({
        "fine_tune_type": "lora", "num_layers": 2, "model": "x",
        "lora_parameters": {"rank": 8, "scale": 20.0, "dropout": 0.0, "keys": None}}))
    out = mlx_to_peft(d, tmp_path / "peft", base_model=str(base))
    cfg = json.loads((out / PEFT_CONFIG).read_text())
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 160.0 and cfg["peft_type"] == "LORA"
    assert cfg["base_model_name_or_path"] == str(base)
    assert cfg["target_modules"] == ["model.layers.1.self_attn.q_proj",
                                     "model.layers.2.self_attn.q_proj"]
    t = load_file(str(out / PEFT_WEIGHTS))
    assert np.array_equal(t["base_model.model.model.layers.2.self_attn.q_proj.lora_B.weight"],
                          w["model.layers.2.self_attn.q_proj.lora_b"].T)
    # and back again: the same mlx-lm tensors
    again = peft_to_mlx(out, tmp_path / "mlx2")
    t2 = load_file(str(again / MLX_WEIGHTS))
    assert all(np.array_equal(t2[k], w[k]) for k in w)
    assert json.loads((again / MLX_CONFIG).read_text())["lora_parameters"]["scale"] == 20.0


def test_refuses_layer_coverage_mlx_lm_cannot_express(tmp_path, base):
    with pytest.raises(AdapterConversionError, match=r"blocks 0,2 are not the last 2 of 3"):
        peft_to_mlx(make_peft(tmp_path / "a", base, layers=(0, 2)), tmp_path / "m1")
    with pytest.raises(AdapterConversionError, match=r"blocks 0-1 are not the last 2 of 3"):
        peft_to_mlx(make_peft(tmp_path / "b", base, layers=(0, 1)), tmp_path / "m2")
    # different keys per block
    p = make_peft(tmp_path / "c", base, layers=(1, 2))
    t = load_file(str(p / PEFT_WEIGHTS))
    del t["base_model.model.model.layers.2.mlp.down_proj.lora_A.weight"]
    del t["base_model.model.model.layers.2.mlp.down_proj.lora_B.weight"]
    save_file(t, str(p / PEFT_WEIGHTS))
    with pytest.raises(AdapterConversionError, match="block 2 adapts different modules"):
        peft_to_mlx(p, tmp_path / "m3")


@pytest.mark.parametrize("targets, r, alpha, dropout", [
    (("q_proj", "k_proj", "v_proj", "o_proj"), 8, 16.0, 0.0),  # the islands' settings
    (("down_proj",), 4, 12, 0.05),
], ids=["attention", "mlp"])
def test_adapter_config_is_what_peft_writes(tmp_path, tiny_llama, targets, r, alpha, dropout):
    """`peft_adapter_config` (no torch, no peft) writes the content peft's own
    save_pretrained writes for the same LoraConfig (target_modules: peft writes a
    set, in hash order; we write it sorted)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama.resolve()), dtype=torch.float32)
    modules = [n for n, _ in model.named_modules() if n.rsplit(".", 1)[-1] in targets]
    pm = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=modules,
                                          lora_dropout=dropout, bias="none",
                                          task_type="CAUSAL_LM"))
    pm.save_pretrained(tmp_path / "peft")
    want = json.loads((tmp_path / "peft" / PEFT_CONFIG).read_text())
    cfg = pm.peft_config["default"]
    text = peft_adapter_config(cfg.base_model_name_or_path, cfg.r, cfg.lora_alpha,
                               cfg.target_modules, cfg.lora_dropout)
    got = json.loads(text)
    assert got["target_modules"] == sorted(modules) and len(modules) >= 2
    assert sorted(want.pop("target_modules")) == got.pop("target_modules")
    assert got == want
    assert got["base_model_name_or_path"] == str(tiny_llama.resolve())
