"""The centre bound (syncer.bounds, "The centre"; `--center-factor`, default 3) is a
default that could change results: it acts on rounds of three or more islands. Honest
fleets of every regime must sit inside it, so that it pulls no honest island in and
their runs merge bit for bit as without it (tests/unit/test_merge_center.py). Real
demos with three islands, SFT on torch and MLX islands and GRPO on torch and on MLX
trainers: every merge of three has its margin on the tape, below the factor, and no
island was pulled in. BENCHMARKS.md, "Trust, round two", holds the full-length runs
that chose the factor (largest honest ratio 1.26)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from syncer.bounds import Bounds

ROOT = Path(__file__).resolve().parents[2]


def _merges(out: Path) -> list[dict]:
    tape = next(p for p in (out / "syncer" / "tape.jsonl", out / "syncer" / "state" / "tape.jsonl")
                if p.exists())
    records = [json.loads(line) for line in tape.open()]
    return [r for r in records if r.get("event") == "merge"]


@pytest.mark.slow
@pytest.mark.regimes
@pytest.mark.mlx
@pytest.mark.parametrize("argv", [
    pytest.param(["--islands", "torch,torch,mlx", "--max-steps", "100"], id="sft-torch-mlx"),
    pytest.param(["--rl", "--trainers", "3", "--max-steps", "30"], id="rl-torch"),
    pytest.param(["--rl", "--trainers", "3", "--trainer", "mlx", "--max-steps", "16"],
                 id="rl-mlx"),
])
def test_the_centre_bound_leaves_honest_fleets_of_three_alone(tmp_path, argv):
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'yeto[mlx]')")
    out = tmp_path / "demo"
    extra = [] if "--rl" in argv else ["--display", "plain", "--no-dashboard"]
    r = subprocess.run([sys.executable, "-m", "yeto", "demo", *argv, *extra, "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    merges = [m for m in _merges(out) if len({x["learner"] for x in m["responders"]}) >= 3]
    assert len(merges) >= 4, f"only {len(merges)} merges of three islands"
    factor = Bounds().center_factor
    ratios = [m["center_ratio"] for m in merges]
    assert all(isinstance(x, float) for x in ratios), ratios  # measured on every one
    assert max(ratios) < factor, ratios
    assert not any(m["center_scales"] for m in merges)
    if "--rl" not in argv:
        s = json.loads((out / "summary.json").read_text())
        assert s["eval_loss_after"] < s["eval_loss_before"], s
