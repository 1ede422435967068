"""The MLX island: config shim, outputs (peft + mlx-lm adapters), a mixed
torch + MLX run against a real syncer process.

Here: the checks that need real processes (the others: tests/unit/test_mlx_island.py,
tests/integration/test_mlx_island.py)."""


import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'yeto[mlx]')")


from helpers.mixed import mixed_run as _mixed_run  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from syncer.spawn import start_syncer  # noqa: E402

pytestmark = pytest.mark.mlx


ROOT = Path(__file__).resolve().parents[2]


# ---- torch + MLX in one run -----------------------------------------------------
def test_torch_and_mlx_islands_sync_to_bit_identical_adapters(tiny_llama, tiny_task, tmp_path):
    _mixed_run(tiny_llama, tiny_task, tmp_path, steps=20, sync_every=5, seq_len=64,
               batch_size=4, inner_lr="1e-3")


@pytest.mark.slow
@pytest.mark.regimes
def test_torch_and_mlx_islands_learn_together(tiny_llama, tiny_task, tmp_path):
    """Held-out loss falls (measured 2.474 -> 2.391 in 40 steps on 2 cores)."""
    s = _mixed_run(tiny_llama, tiny_task, tmp_path, steps=40, sync_every=10, seq_len=128,
                   batch_size=8, inner_lr="3e-3")
    for iid, x in s.items():
        assert x["eval_loss"] < x["eval_loss_before"] - 0.03, (iid, x)


# ---- no torch ------------------------------------------------------------------------
NO_TORCH = ("import sys, runpy\n"
            "for m in ('torch', 'peft'): sys.modules[m] = None\n"
            "sys.argv = ['yeto.mlx.learner', *sys.argv[1:]]\n"
            "runpy.run_module('yeto.mlx.learner', run_name='__main__')\n")


def test_mlx_island_runs_with_torch_and_peft_unimportable(tiny_llama, tiny_task, tmp_path):
    """`pip install "yeto[mlx]"` has no torch and no peft: the island trains against a
    real syncer and writes its peft and mlx-lm adapters without them."""
    train, held_out = tiny_task
    probe = subprocess.run([sys.executable, "-c", NO_TORCH.split("sys.argv")[0] +
                            "import torch"], capture_output=True, text=True)
    assert "ModuleNotFoundError" in probe.stderr or "ImportError" in probe.stderr
    with start_syncer(["--quorum", "1", "--state-dir", str(tmp_path / "s")], cwd=ROOT) as syncer:
        r = subprocess.run(
            [sys.executable, "-c", NO_TORCH, "--model", str(tiny_llama), "--data", str(train),
             "--eval-data", str(held_out), "--syncer", syncer.address, "--max-steps", "4",
             "--sync-every", "2", "--seq-len", "32", "--batch-size", "2", "--lora-r", "4",
             "--eval-blocks", "4", "--output", str(tmp_path / "out"), "--no-progress"],
            cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["final"] and summary["version"] >= 2 and summary["pushes"] >= 2
    mine = load_file(str(tmp_path / "out" / "adapter" / "adapter_model.safetensors"))
    final = load_file(str(tmp_path / "s" / "final" / "adapter_model.safetensors"))
    assert mine.keys() == final.keys() and all(np.array_equal(mine[k], final[k]) for k in mine)
    assert (tmp_path / "out" / "mlx" / "adapters.safetensors").is_file()
