"""Adapters that are finite but absurd (issue 44, item 9): values such as 1e30 or a
lora_alpha of 1e38 make every logprob NaN. `yeto export` and `yeto convert` refuse
them in one line that names the tensor or the config field and the bound
(`yeto.interop.adapters.MAX_FACTOR_ABS`, `MAX_LORA_SCALE`, the bounds rollout nodes
apply too); healthy adapters pass.

Here: the checks that need no process, server or training (the rollout node's:
tests/integration/test_rollout_bounds.py; the CLIs as subprocesses:
tests/e2e/test_adapter_bounds.py)."""

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from syncer import state
from yeto.interop.adapters import (
    MAX_FACTOR_ABS,
    MAX_LORA_SCALE,
    MLX_CONFIG,
    MLX_WEIGHTS,
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    peft_adapter_config,
    peft_to_mlx,
    save_peft_adapter,
    scale_problem,
    values_problem,
)
from yeto.interop.export import main_convert, main_export

MODULES = [f"model.layers.{i}.self_attn.{m}" for i in (0, 1) for m in ("q_proj", "v_proj")]
HUGE = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
FACTOR_BOUND, SCALE_BOUND = f"{MAX_FACTOR_ABS:g}", f"{MAX_LORA_SCALE:g}"


def tensors(r=2, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for m in MODULES:
        out[f"base_model.model.{m}.lora_A.weight"] = rng.standard_normal((r, 8), np.float32)
        out[f"base_model.model.{m}.lora_B.weight"] = rng.standard_normal((8, r), np.float32)
    return out


def peft_adapter(out: Path, base, r=2, alpha=4.0, values=None) -> Path:
    cfg = peft_adapter_config(str(base), r, alpha, ["q_proj", "v_proj"])
    return save_peft_adapter(out, values or tensors(r), cfg)


def base_model(tmp: Path) -> Path:
    model = tmp / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    return model


def huge() -> dict[str, np.ndarray]:
    t = tensors()
    t[HUGE] = t[HUGE].copy()
    t[HUGE][3, 1] = 1e30
    return t


def refused(capsys, *words) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err  # one line
    for w in words:
        assert str(w) in err, (w, err)
    return err


def test_the_bounds_name_what_is_beyond_them():
    assert values_problem("t", np.float32([0.5, -MAX_FACTOR_ABS])) is None
    assert "1e+30" in values_problem("t", np.float32([0.5, 1e30]))
    assert "non-finite" in values_problem("t", np.float32([np.nan]))
    assert values_problem("ids", np.int64([10**12])) is None  # not a LoRA value
    assert scale_problem({"r": 16, "lora_alpha": 32}) is None
    for cfg, field in (({"r": 16, "lora_alpha": 1e38}, "lora_alpha"),
                       ({"r": 1, "lora_alpha": -2e4}, "lora_alpha"),
                       ({"r": 1, "lora_alpha": 10**400}, "lora_alpha"),
                       ({"r": 1, "lora_alpha": float("nan")}, "lora_alpha"),
                       ({"r": 2, "lora_alpha": 4, "alpha_pattern": {"q_proj": 1e9}},
                        "alpha_pattern['q_proj']"),
                       ({"lora_parameters": {"rank": 2, "scale": 1e38}},
                        "lora_parameters.scale")):
        problem = scale_problem(cfg)
        assert problem and problem.startswith(field) and SCALE_BOUND in problem, (cfg, problem)


@pytest.mark.parametrize("fmt", ["peft", "mlx"])
def test_export_refuses_a_final_adapter_beyond_the_bounds(tmp_path, capsys, fmt):
    final = tmp_path / "run" / "final"
    out = tmp_path / "out"
    args = ["--state-dir", str(tmp_path / "run"), "--out", str(out), "--format", fmt,
            "--base-model", str(base_model(tmp_path))]
    peft_adapter(final, "model", values=huge())
    assert main_export(args) == 2
    refused(capsys, final / PEFT_WEIGHTS, HUGE, "1e+30", FACTOR_BOUND)
    peft_adapter(final, "model", alpha=2e38)
    assert main_export(args) == 2
    refused(capsys, final / PEFT_CONFIG, "lora_alpha", SCALE_BOUND)
    assert not out.exists()
    peft_adapter(final, "model")
    assert main_export(args) == 0


def test_export_refuses_an_unfinished_runs_weights_beyond_the_bounds(tmp_path, capsys):
    t = huge()
    names = sorted(t)
    meta = dict(version=4, weights_file=PEFT_WEIGHTS,
                layout=[[n, list(t[n].shape), "float32"] for n in names],
                export_files={PEFT_CONFIG: peft_adapter_config("model", 2, 4.0,
                                                               ["q_proj", "v_proj"])})
    state.save(tmp_path / "run", np.concatenate([t[n].reshape(-1) for n in names]), None,
               None, meta)
    out = tmp_path / "out"
    assert main_export(["--state-dir", str(tmp_path / "run"), "--out", str(out)]) == 2
    refused(capsys, "state.safetensors", HUGE, FACTOR_BOUND)
    assert not out.exists()


def test_convert_refuses_a_peft_adapter_beyond_the_bounds(tmp_path, capsys):
    base = base_model(tmp_path)
    for name, kw, words in (("huge", dict(values=huge()), (HUGE, FACTOR_BOUND)),
                            ("alpha", dict(alpha=1e38), ("lora_alpha", SCALE_BOUND))):
        src = peft_adapter(tmp_path / name, base, **kw)
        assert main_convert([str(src), str(tmp_path / f"{name}-mlx"), "--to", "mlx"]) == 2
        refused(capsys, src, *words)
        assert not (tmp_path / f"{name}-mlx").exists()


def test_convert_refuses_an_mlx_adapter_beyond_the_bounds(tmp_path, capsys):
    base = base_model(tmp_path)
    src = peft_to_mlx(peft_adapter(tmp_path / "peft", base), tmp_path / "mlx")
    back = ["--to", "peft", "--base-model", str(base)]
    assert main_convert([str(src), str(tmp_path / "ok"), *back]) == 0
    cfg = json.loads((src / MLX_CONFIG).read_text())
    cfg["lora_parameters"]["scale"] = 1e38
    (src / MLX_CONFIG).write_text(json.dumps(cfg))
    assert main_convert([str(src), str(tmp_path / "back"), *back]) == 2
    refused(capsys, src / MLX_CONFIG, "lora_parameters.scale", SCALE_BOUND)
    cfg["lora_parameters"]["scale"] = 2.0
    (src / MLX_CONFIG).write_text(json.dumps(cfg))
    weights = load_file(src / MLX_WEIGHTS)
    name = sorted(weights)[0]
    weights[name] = np.full_like(weights[name], -3e30)
    save_file(weights, str(src / MLX_WEIGHTS))
    assert main_convert([str(src), str(tmp_path / "back"), *back]) == 2
    refused(capsys, src / MLX_WEIGHTS, name, "3e+30", FACTOR_BOUND)
    assert not (tmp_path / "back").exists()
