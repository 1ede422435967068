"""`yeto launch`: real syncer and island processes; Ctrl-C stops with outputs saved.

The islands are the ordinary island programs (`python -m yeto.learner`): the launcher
passes a Ctrl-C on to them as SIGINT, and each one finishes its step, pushes, receives
the final weights and saves, by its own signal handling.

Here: the checks that need real processes (the others: tests/unit/test_launch.py,
tests/integration/test_launch.py)."""


import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from syncer.tape import read_tape
from yeto.cli import launch

ROOT = Path(__file__).resolve().parents[2]


SMALL = ["--seq-len", "64", "--batch-size", "4", "--lora-r", "4", "--eval-blocks", "8",
         "--inner-lr", "3e-3"]


def _launched(out, model, task, *extra) -> subprocess.CompletedProcess:
    """A finished `yeto launch` of two islands, 12 steps, a push every 4."""
    train, held_out = task
    r = subprocess.run(_launch_cmd(out, model, train, held_out, "--max-steps", "12",
                                   "--sync-every", "4", *extra),
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _islands_hold_the_final_adapter(out) -> None:
    """OUT/adapter is what both islands saved, tensor for tensor, bit for bit."""
    final = load_file(out / "adapter" / "adapter_model.safetensors")
    for island in ("island-0", "island-1"):
        mine = load_file(out / "islands" / island / "adapter" / "adapter_model.safetensors")
        assert mine.keys() == final.keys(), island
        assert all(np.array_equal(mine[k], final[k]) for k in final), island


def _launch_cmd(out, model, train, held_out, *extra):
    return [sys.executable, "-m", "yeto", "launch", "--model", str(model), "--data", str(train),
            "--eval-data", str(held_out), "--out", str(out), "--display", "plain", *SMALL, *extra]


@pytest.mark.long  # ~10 s of launch and signals: .ci/run runs it after the default tier
def test_ctrl_c_stops_everything_with_outputs_saved(tmp_path, tiny_llama, tiny_task):
    train, held_out = tiny_task
    out = tmp_path / "run"
    proc = subprocess.Popen(_launch_cmd(out, tiny_llama, train, held_out, "--max-steps", "5000",
                                        "--sync-every", "2"),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:  # wait until training is under way: a merged round
            lines.append(line)  # (a hang is bounded by the suite's per-test timeout)
            if line.startswith("round   1:"):
                break
        assert lines and lines[-1].startswith("round   1:"), "".join(lines)  # not ended
        proc.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends
        rest, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    stdout = "".join(lines) + rest
    assert proc.returncode == 130, stdout
    assert "SIGINT: stopping the islands" in stdout
    assert f"outputs in {out}" in stdout and "stopped early by a signal" in stdout
    # the run finished cleanly: the syncer wrote final/, every island saved an adapter
    # bit-identical to it, and summary.json is there
    final = load_file(out / "adapter" / "adapter_model.safetensors")
    for island in ("island-0", "island-1"):
        mine = load_file(out / "islands" / island / "adapter" / "adapter_model.safetensors")
        assert mine.keys() == final.keys()
        assert all(np.array_equal(mine[k], final[k]) for k in final), island
        s = json.loads((out / "islands" / island / "summary.json").read_text())
        assert s["final"] is True and 2 <= s["step"] < 5000
        # the island program itself took the signal and stopped cleanly (no wrapper)
        assert "SIGINT: stopping after this step" in \
            (out / "islands" / island / "log.txt").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] >= 1 and set(summary["islands"]) == {"island-0", "island-1"}
    assert all(v["final"] for v in summary["islands"].values())
    merges = [r for r in read_tape(out / "syncer" / "tape.jsonl") if r["event"] == "merge"]
    assert len(merges) == summary["rounds"]
    # bytes: the run's summary is the islands' own counts summed (the seed and the final
    # weights included), so the two files agree
    mine = [json.loads((out / "islands" / i / "summary.json").read_text())
            for i in ("island-0", "island-1")]
    assert summary["bytes_up"] == sum(s["bytes_up"] for s in mine) > 0
    assert summary["bytes_down"] == sum(s["bytes_down"] for s in mine) > 0
    # the display: a status table with both islands, and the syncer's dashboard URL
    assert "island-0  torch" in stdout and "island-1  torch" in stdout
    assert "dashboard http://127.0.0.1:" in stdout
    # a second launch into the same folder refuses to overwrite it
    again = subprocess.run(_launch_cmd(out, tiny_llama, train, held_out, "--max-steps", "3"),
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "--overwrite" in again.stderr


def test_a_failing_island_stops_the_run_with_its_log(tmp_path, tiny_llama, tiny_task):
    train, held_out = tiny_task
    out = tmp_path / "bad"
    r = subprocess.run(_launch_cmd(out, tiny_llama, train, held_out, "--islands", "torch",
                                   "--max-steps", "3", "--no-such-flag", "1", "--no-dashboard"),
                       cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "island-0 exited with code 2" in r.stdout
    assert "unrecognized arguments: --no-such-flag" in r.stdout  # the island's log tail


@pytest.mark.slow
@pytest.mark.regimes
@pytest.mark.mlx
def test_launch_torch_and_mlx_islands(tmp_path, tiny_llama, tiny_task):
    pytest.importorskip("mlx_lm")
    out = tmp_path / "mixed"
    r = _launched(out, tiny_llama, tiny_task, "--islands", "torch,mlx")
    assert "island-1  mlx" in r.stdout and "held-out loss:" in r.stdout
    _islands_hold_the_final_adapter(out)
    merges = [r for r in read_tape(out / "syncer" / "tape.jsonl") if r["event"] == "merge"]
    assert len(merges) == 3


def test_a_syncer_that_cannot_start_is_reported_with_its_output(tmp_path, capsys):
    """syncer.spawn: a syncer that exits before it listens fails at once with the end of
    its output (no waiting out a timeout); the launcher says so and exits 2."""
    from syncer.spawn import SyncerStartError, start_syncer

    # the exit path, not the timeout path ("did not listen within ..."): no clock needed
    with pytest.raises(SyncerStartError,
                       match="exited with code 2 before it listened(.|\n)*unrecognized "
                             "arguments: --bogus"):
        start_syncer(["--bogus"], timeout_s=3600)
    code = launch.main(["--model", "m", "--data", "d", "--out", str(tmp_path / "run"),
                        "--syncer-args=--bogus", "--display", "none"])
    err = capsys.readouterr().err
    assert code == 2 and "exited with code 2 before it listened" in err and "--bogus" in err


def test_launch_with_two_shards(tmp_path, tiny_llama, tiny_task):
    """`yeto launch --shards 2`: two syncer shards (OUT/syncer, OUT/syncer-1), each
    running the rounds of its fragment; OUT/adapter, assembled from both shards' states,
    is the final adapter every island saved, bit for bit."""
    out = tmp_path / "sharded"
    r = _launched(out, tiny_llama, tiny_task, "--shards", "2")
    assert "held-out loss:" in r.stdout and f"--state-dir {out / 'syncer-1'}" in r.stdout
    # shard 0 starts last, its dashboard given every shard (itself as "self")
    assert "(every shard: self;127.0.0.1:" in (out / "syncer" / "log.txt").read_text()
    _islands_hold_the_final_adapter(out)
    for d in ("syncer", "syncer-1"):  # each shard merged rounds of its own fragment
        merges = [r for r in read_tape(out / d / "tape.jsonl") if r["event"] == "merge"]
        assert merges and {m["fragment"] for m in merges} == {0 if d == "syncer" else 1}, d
