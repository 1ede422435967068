"""peft <-> mlx-lm adapter conversion (numpy only; no mlx needed).

Here: the checks that need no process, server or training (the others:
tests/integration/test_adapters.py, tests/e2e/test_adapters.py)."""


import json
from pathlib import Path

import numpy as np
import pytest
from helpers.adapters import KEYS, make_peft
from safetensors.numpy import load_file, save_file

from yeto.interop.adapters import (
    MLX_CONFIG,
    MLX_WEIGHTS,
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    AdapterConversionError,
    mlx_to_peft,
    peft_to_mlx,
)


@pytest.fixture
def base(tmp_path) -> Path:
    d = tmp_path / "base"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 3}))
    return d


def test_peft_to_mlx_layout(tmp_path, base):
    peft = make_peft(tmp_path / "peft", base, layers=(1, 2))
    mlx = peft_to_mlx(peft, tmp_path / "mlx")
    cfg = json.loads((mlx / MLX_CONFIG).read_text())
    assert cfg["fine_tune_type"] == "lora" and cfg["num_layers"] == 2
    assert cfg["lora_parameters"] == {"rank": 4, "scale": 2.0, "dropout": 0.0, "keys": list(KEYS)}
    src = load_file(str(peft / PEFT_WEIGHTS))
    out = load_file(str(mlx / MLX_WEIGHTS))
    assert len(out) == len(src)
    a = src["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"]
    b = src["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    assert out["model.layers.1.self_attn.v_proj.lora_a"].shape == (128, 4)  # (in, r)
    assert out["model.layers.1.self_attn.v_proj.lora_b"].shape == (4, 64)  # (r, out)
    assert np.array_equal(out["model.layers.1.self_attn.v_proj.lora_a"], a.T)
    assert np.array_equal(out["model.layers.1.self_attn.v_proj.lora_b"], b.T)


def test_round_trip_is_bit_exact(tmp_path, base):
    peft = make_peft(tmp_path / "peft", base, alpha=7.0, r=3)
    peft_to_mlx(peft, tmp_path / "mlx")
    back = mlx_to_peft(tmp_path / "mlx", tmp_path / "back", base_model=str(base))
    a, b = load_file(str(peft / PEFT_WEIGHTS)), load_file(str(back / PEFT_WEIGHTS))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k
    assert (peft / PEFT_WEIGHTS).read_bytes() == (back / PEFT_WEIGHTS).read_bytes()
    assert json.loads((peft / PEFT_CONFIG).read_text()) == \
        json.loads((back / PEFT_CONFIG).read_text())


@pytest.mark.parametrize("change, words", [
    ({"use_rslora": True}, "rsLoRA"),
    ({"use_dora": True}, "DoRA"),
    ({"rank_pattern": {"q_proj": 8}}, "per-module ranks"),
    ({"alpha_pattern": {"q_proj": 8}}, "per-module alphas"),
    ({"lora_bias": True}, "LoRA biases"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"peft_type": "IA3"}, "not LoRA"),
])
def test_refuses_config_features(tmp_path, base, change, words):
    peft = make_peft(tmp_path / "peft", base, **change)
    with pytest.raises(AdapterConversionError, match=words):
        peft_to_mlx(peft, tmp_path / "mlx")
    assert not (tmp_path / "mlx").exists()


def test_refuses_tensors_it_cannot_convert(tmp_path, base):
    p = make_peft(tmp_path / "a", base)
    t = load_file(str(p / PEFT_WEIGHTS))
    t["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"] = \
        np.ones(128, np.float32)
    save_file(t, str(p / PEFT_WEIGHTS))
    with pytest.raises(AdapterConversionError, match="DoRA magnitudes"):
        peft_to_mlx(p, tmp_path / "m1")
    # a module with its own rank
    p = make_peft(tmp_path / "b", base)
    t = load_file(str(p / PEFT_WEIGHTS))
    t["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] = \
        np.ones((2, 128), np.float32)
    t["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"] = \
        np.ones((128, 2), np.float32)
    save_file(t, str(p / PEFT_WEIGHTS))
    with pytest.raises(AdapterConversionError, match="rank 2, the config says r=4"):
        peft_to_mlx(p, tmp_path / "m2")
    # no base model to count the blocks
    p = make_peft(tmp_path / "c", tmp_path / "nowhere")
    with pytest.raises(AdapterConversionError, match="pass base_model="):
        peft_to_mlx(p, tmp_path / "m3")
    assert peft_to_mlx(p, tmp_path / "m4", base_model=base).is_dir()


def test_mlx_to_peft_refusals(tmp_path, base):
    d = tmp_path / "dora"
    d.mkdir()
    save_file({"model.layers.2.self_attn.q_proj.lora_a": np.ones((128, 8), np.float32)},
              str(d / MLX_WEIGHTS))
    (d / MLX_CONFIG).write_text(json.dumps({"fine_tune_type": "dora", "num_layers": 1,
                                            "lora_parameters": {"rank": 8, "scale": 2.0}}))
    with pytest.raises(AdapterConversionError, match="fine_tune_type 'dora'"):
        mlx_to_peft(d, tmp_path / "out", base_model=str(base))
    (d / MLX_CONFIG).write_text(json.dumps({"fine_tune_type": "lora", "num_layers": 1,
                                            "lora_parameters": {"rank": 8, "scale": 2.0}}))
    with pytest.raises(AdapterConversionError, match="has only lora_a"):
        mlx_to_peft(d, tmp_path / "out", base_model=str(base))
    save_file({"model.layers.2.self_attn.q_proj.m": np.ones(128, np.float32)},
              str(d / MLX_WEIGHTS))
    with pytest.raises(AdapterConversionError, match="not a LoRA factor"):
        mlx_to_peft(d, tmp_path / "out", base_model=str(base))


def test_run_adapter_tensors_rebuild_frozen_a():
    """A frozen-A run's merged weights hold only lora_B; its adapter gets lora_A back
    from the shared seed, bit for bit (yeto.frozen), and a plain run's is unchanged."""
    from yeto import frozen
    from yeto.frozen import run_adapter_tensors

    a_name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    b = {a_name.replace("lora_A", "lora_B"): np.ones((16, 4), np.float32)}
    assert run_adapter_tensors(b, {PEFT_CONFIG: "{}"}).keys() == b.keys()
    out = run_adapter_tensors(b, {frozen.EXPORT_FILE: frozen.describe(7, {a_name: (4, 16)})})
    assert sorted(out) == sorted([a_name, *b])
    assert out[a_name].tobytes() == frozen.frozen_lora_a(a_name, (4, 16), 7).tobytes()
    assert out[a_name].std() > 0.05  # U(±1/4), not zeros
