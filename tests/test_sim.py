"""`python -m yeto.sim`: a fleet in one process computes what real processes compute."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from syncer.spawn import start_syncer
from syncer.tape import read_tape

ROOT = Path(__file__).resolve().parents[1]
ROUNDS, H = 3, 5


def _island_args(model: Path, task) -> list[str]:
    train, held_out = task
    return ["--model", str(model), "--data", str(train), "--eval-data", str(held_out),
            "--sync-every", str(H), "--max-steps", str(ROUNDS * H), "--seq-len", "32",
            "--batch-size", "4", "--lora-r", "4", "--eval-blocks", "4", "--blocking-sync",
            "--threads", "1", "--seed", "3", "--no-progress"]


def _real_run(model: Path, task, out: Path) -> Path:
    with start_syncer(["--quorum", "2", "--grace-ms", "0", "--state-dir", str(out / "syncer")],
                      cwd=ROOT) as syncer:
        procs = [subprocess.Popen(
            [sys.executable, "-m", "yeto.learner", *_island_args(model, task), "--syncer",
             syncer.address, "--learner-id", f"island-{i}", "--num-learners", "2",
             "--output", str(out / "islands" / f"island-{i}")],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for i in range(2)]
        for p in procs:
            _, err = p.communicate(timeout=600)
            assert p.returncode == 0, err[-3000:]
        syncer.proc.wait(timeout=120)
    return out


def _sim_run(model: Path, task, out: Path) -> tuple[Path, str]:
    r = subprocess.run([sys.executable, "-m", "yeto.sim", *_island_args(model, task),
                        "--islands", "2", "--grace-ms", "0", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r.stdout


def _merges(out: Path) -> list[dict]:
    return [r for r in read_tape(out / "syncer" / "tape.jsonl") if r["event"] == "merge"]


def test_sim_equals_real(tiny_llama, tiny_task, tmp_path):
    real = _real_run(tiny_llama, tiny_task, tmp_path / "real")
    sim, stdout = _sim_run(tiny_llama, tiny_task, tmp_path / "sim")
    final = "syncer/final/adapter_model.safetensors"
    a, b = load_file(str(real / final)), load_file(str(sim / final))
    assert a.keys() == b.keys()
    moved = max(float(np.abs(b[k]).max()) for k in b if "lora_B" in k)
    assert moved > 0  # training happened: lora_B starts at zero
    for k in a:
        np.testing.assert_allclose(b[k], a[k], atol=1e-6, rtol=0, err_msg=k)
    ra, rb = _merges(real), _merges(sim)
    assert len(ra) == len(rb) == ROUNDS
    for x, y in zip(ra, rb):
        assert x["bytes_in"] == y["bytes_in"] and x["bytes_out"] == y["bytes_out"]
        tokens = lambda rec: sorted((s["learner"], s["tokens"], s["steps"])  # noqa: E731
                                    for s in rec["responders"])
        assert tokens(x) == tokens(y)
    summary = json.loads((sim / "summary.json").read_text())
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT eval_loss=") and f"rounds={ROUNDS}" in last
    assert summary["rounds"] == ROUNDS and summary["bytes_up"] > 0


def test_speeds_give_every_island_the_same_wall_time(tmp_path):
    """--speeds 1,3: the slow island's steps take 3x as long, so it trains a third of
    --max-steps and both islands stop at about the same time."""
    from yeto.config import IslandConfig
    from yeto.sim.fleet import island_configs

    base = IslandConfig(model="m", max_steps=90)
    cfgs = island_configs(base, 2, tmp_path, [1.0, 3.0])
    assert [(c.learner_id, c.slowdown, c.max_steps) for c in cfgs] == \
        [("island-0", 1.0, 90), ("island-1", 3.0, 30)]
    assert [c.max_steps for c in island_configs(base, 2, tmp_path, [])] == [90, 90]
