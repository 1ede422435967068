"""An island made of a torchrun group (2 CPU processes, gloo) beside a single-process
island, against one syncer: real processes, real signals."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.wait import wait_until
from safetensors.numpy import load_file

from syncer.spawn import SyncerProcess, start_syncer
from syncer.tape import read_tape

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _syncer(tmp: Path) -> SyncerProcess:
    return start_syncer(["--quorum", "2", "--state-dir", str(tmp / "s"), "--round-timeout-s",
                         "30"], cwd=ROOT, log=tmp / "syncer.log")


def _islands(tmp, address, model, task, steps, master_port):
    train, held_out = task
    common = ["--model", str(model), "--data", str(train), "--eval-data", str(held_out),
              "--syncer", address, "--num-learners", "2", "--max-steps", str(steps),
              "--sync-every", "10", "--seq-len", "64", "--batch-size", "4", "--no-progress",
              "--threads", "1"]
    group = subprocess.Popen([str(TORCHRUN), "--nproc-per-node", "2", "--master-port",
                              str(master_port), "-m", "yeto.learner", *common, "--learner-id",
                              "island-0", "--output", str(tmp / "i0")], cwd=ROOT,
                             stdout=open(tmp / "i0.log", "w"), stderr=subprocess.STDOUT,
                             start_new_session=True)
    single = subprocess.Popen([sys.executable, "-m", "yeto.learner", *common, "--learner-id",
                               "island-1", "--output", str(tmp / "i1")], cwd=ROOT,
                              stdout=open(tmp / "i1.log", "w"), stderr=subprocess.STDOUT)
    return group, single


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed")
def test_torchrun_island_counts_once_and_ranks_stay_identical(tmp_path, tiny_llama, tiny_task):
    syncer = _syncer(tmp_path)
    group, single = _islands(tmp_path, syncer.address, tiny_llama, tiny_task, 40, _free_port())
    try:
        assert group.wait(timeout=300) == 0, (tmp_path / "i0.log").read_text()[-3000:]
        assert single.wait(timeout=300) == 0, (tmp_path / "i1.log").read_text()[-3000:]
        assert syncer.wait(timeout=60) == 0
    finally:
        for p in (group, single, syncer):
            if p.poll() is None:
                p.kill()
    ranks = [(tmp_path / "i0" / f"rank-{r}.jsonl").read_text().splitlines() for r in (0, 1)]
    assert len(ranks[0]) >= 3 and ranks[0] == ranks[1]  # identical after every merge
    merges = [r for r in read_tape(tmp_path / "s" / "tape.jsonl") if r["event"] == "merge"]
    for rec in merges:
        tokens = {x["learner"]: x["tokens"] for x in rec["responders"]}
        assert sorted(x["learner"] for x in rec["responders"]) == ["island-0", "island-1"]
        assert tokens["island-0"] > 1.5 * tokens["island-1"]  # two ranks' tokens, summed
    final = load_file(tmp_path / "s" / "final" / "adapter_model.safetensors")
    for island in ("i0", "i1"):
        mine = load_file(tmp_path / island / "adapter" / "adapter_model.safetensors")
        assert all(np.array_equal(mine[k], final[k]) for k in final)
    assert json.loads((tmp_path / "i0" / "summary.json").read_text())["ranks"] == 2


def _alive(pids: list[int]) -> list[int]:
    """The processes among `pids` still running (neither gone nor zombies)."""
    out = []
    for pid in pids:
        try:
            if "zombie" not in Path(f"/proc/{pid}/status").read_text():
                out.append(pid)
        except OSError:
            pass
    return out


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


@pytest.mark.long  # minute-scale: .ci/run runs it after the default tier
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed")
def test_killing_one_rank_takes_the_island_down_and_the_run_goes_on(tmp_path, tiny_llama,
                                                                   tiny_task):
    syncer = _syncer(tmp_path)
    group, single = _islands(tmp_path, syncer.address, tiny_llama, tiny_task, 200, _free_port())
    try:
        tape = tmp_path / "s" / "tape.jsonl"
        assert wait_until(lambda: tape.exists() and "merge" in tape.read_text(), timeout=180)
        workers = _children(group.pid)
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGKILL)
        assert group.wait(timeout=120) != 0  # the whole island goes down ...
        assert wait_until(lambda: not _alive(workers), timeout=60), _alive(workers)  # no hangs
        assert single.wait(timeout=300) == 0  # ... and the run continues without it
        assert syncer.wait(timeout=60) == 0
    finally:
        for p in (group, single, syncer):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL) if p is group else p.kill()
    merges = [r for r in read_tape(tmp_path / "s" / "tape.jsonl") if r["event"] == "merge"]
    alone = [r for r in merges if [x["learner"] for x in r["responders"]] == ["island-1"]]
    assert alone, "no round after the kill merged island-1 alone"
    assert json.loads((tmp_path / "i1" / "summary.json").read_text())["final"]
