"""Adapters that are finite but absurd (issue 44, item 9), handed to `yeto convert`
as a user runs it: refused in one line naming the tensor or field and the bound,
with a non-zero exit and no traceback.

Here: the CLI as a subprocess (the others: tests/unit/test_adapter_bounds.py,
tests/integration/test_rollout_bounds.py)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from yeto.interop.adapters import (
    MAX_FACTOR_ABS,
    MAX_LORA_SCALE,
    MLX_WEIGHTS,
    peft_adapter_config,
    save_peft_adapter,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("case", ["values", "alpha"])
def test_convert_refuses_an_absurd_adapter_in_one_line(tmp_path, case):
    rng = np.random.default_rng(0)
    tensors = {}
    for i in (0, 1):
        m = f"base_model.model.model.layers.{i}.self_attn.q_proj"
        tensors[f"{m}.lora_A.weight"] = rng.standard_normal((2, 8)).astype(np.float32)
        tensors[f"{m}.lora_B.weight"] = rng.standard_normal((8, 2)).astype(np.float32)
    name = sorted(tensors)[1]
    if case == "values":
        tensors[name] = np.full_like(tensors[name], 1e30)
    alpha = 1e38 if case == "alpha" else 4.0
    src = save_peft_adapter(tmp_path / "peft", tensors,
                            peft_adapter_config("model", 2, alpha, ["q_proj"]))
    p = subprocess.run([sys.executable, "-m", "yeto", "convert", str(src), str(tmp_path / "mlx"),
                        "--to", "mlx"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.count("\n") == 1, p.stderr
    words = ((name, f"{MAX_FACTOR_ABS:g}") if case == "values"
             else ("lora_alpha", f"{MAX_LORA_SCALE:g}"))
    assert all(w in p.stderr for w in words), p.stderr
    assert not (tmp_path / "mlx" / MLX_WEIGHTS).exists()
