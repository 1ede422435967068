"""`python -m yeto.sim`: a fleet in one process computes what real processes compute.

Here: the checks that need real processes (the others: tests/unit/test_sim.py)."""


from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from helpers.wait import run_together
from safetensors.numpy import load_file

from syncer.spawn import start_syncer
from syncer.tape import read_tape

ROOT = Path(__file__).resolve().parents[2]


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
    return out, _sim(*_island_args(model, task), "--islands", "2", "--grace-ms", "0",
                     "--out", out)


def _merges(out: Path) -> list[dict]:
    return [r for r in read_tape(out / "syncer" / "tape.jsonl") if r["event"] == "merge"]


@pytest.mark.long  # a real run and its sim, ~13 s: .ci/run runs it after the default tier
def test_sim_equals_real(tiny_llama, tiny_task, tmp_path):
    with ThreadPoolExecutor(1) as pool:  # the sim's process beside the real ones
        simulated = pool.submit(_sim_run, tiny_llama, tiny_task, tmp_path / "sim")
        real = _real_run(tiny_llama, tiny_task, tmp_path / "real")
        sim, stdout = simulated.result()
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


def _sim(*argv) -> str:
    """`python -m yeto.sim ARGV`; returns what it printed. (In a process of its own:
    its islands load models on threads, and this process's later tests saw
    transformers' tied weights come apart after it ran here.)"""
    r = subprocess.run([sys.executable, "-m", "yeto.sim", *map(str, argv)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def _sims(*argvs) -> list[str]:
    """`_sim` of each argv, the processes running at the same time: on simulated time
    the machine's load must not change what they compute (it once did: an island
    resumed late when another had moved the fleet's time on first)."""
    done = run_together(*(["-m", "yeto.sim", *a] for a in argvs), cwd=ROOT)
    for r in done:
        assert r.returncode == 0, r.stderr[-3000:]
    return [r.stdout for r in done]


def _simulated(model: Path, task, *outs: Path) -> list[tuple[dict, list[dict]]]:
    """Two islands at speeds 1 and 2 syncing every 1.25 simulated seconds (a step at
    speed 1 costs 0.125 s: sums exact in binary), through `python -m yeto.sim`, once
    into each of `outs` (at the same time)."""
    args = [a for a in _island_args(model, task) if a != "--blocking-sync"]
    printed = _sims(*([*args, "--islands", "2", "--speeds", "1,2", "--step-seconds", "0.125",
                       "--sync-every-seconds", "1.25", "--max-steps", "40", "--grace-ms", "0",
                       "--out", out] for out in outs))
    assert all("goodput" in p for p in printed)
    return [(load_file(str(out / "syncer/final/adapter_model.safetensors")), _merges(out))
            for out in outs]


@pytest.mark.long  # minute-scale: .ci/run runs it after the default tier
def test_simulated_time_syncs_by_simulated_seconds_and_repeats_exactly(tiny_llama, tiny_task,
                                                                    tmp_path):
    """On simulated time an island twice as slow pushes every 5 steps where the fast one
    pushes every 10 (1.25 simulated seconds each), and a second run ends with the same
    weights, bit for bit: the order of events no longer depends on the machine."""
    (first, merges), (second, again) = _simulated(tiny_llama, tiny_task, tmp_path / "one",
                                                  tmp_path / "two")  # at the same time
    steps = {(s["learner"], s["steps"]) for m in merges for s in m["responders"]}
    assert steps == {("island-0", 10), ("island-1", 5)}
    assert len(merges) == 4 and [m["responders"] for m in merges] == \
        [m["responders"] for m in again]
    assert first.keys() == second.keys()
    for k in first:
        np.testing.assert_array_equal(first[k], second[k], err_msg=k)


@pytest.mark.long  # minute-scale: .ci/run runs it after the default tier
def test_simulated_time_counts_the_waits_for_slower_islands(tiny_llama, tiny_task, tmp_path):
    """Speeds 1, 2, 4 (steps of 0.125, 0.25, 0.5 simulated s), blocking sync every 10
    steps, every island in every round: the fast islands wait at each round for the
    slowest, whose 15 steps end at 7.5 s. Island 0: rounds commit at 5, 7.5, 10, then
    alone at 11.25, 12.5, 13.75, so its 7.5 s of steps end at 13.75 (goodput 7.5 /
    13.75); island 1's 30 steps end at 10 (0.75); island 2 never waits."""
    out = tmp_path / "sim"
    args = _island_args(tiny_llama, tiny_task)
    _sim(*args, "--islands", "3", "--speeds", "1,2,4", "--step-seconds", "0.125",
         "--sync-every", "10", "--max-steps", "60", "--out", out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["simulated_s"] == 13.75
    assert summary["goodput"] == {"island-0": 7.5 / 13.75, "island-1": 0.75, "island-2": 1.0}
    assert [len(m["responders"]) for m in _merges(out)] == [3, 3, 2, 1, 1, 1]


@pytest.mark.long  # minute-scale: .ci/run runs it after the default tier
def test_step_jitter_makes_equal_islands_wait_and_still_repeats(tiny_llama, tiny_task, tmp_path):
    """Two islands of equal speed, blocking sync, --step-jitter 0.5: without jitter they
    end each round at the same instant and nobody waits (goodput 1); with it one waits
    for the other at every round, and a second run repeats the first exactly."""
    runs = {"plain": [], "one": ["--step-jitter", "0.5"], "two": ["--step-jitter", "0.5"]}
    _sims(*([*_island_args(tiny_llama, tiny_task), "--islands", "2", "--step-seconds",
             "0.125", *extra, "--out", tmp_path / name] for name, extra in runs.items()))
    plain, first, second = (json.loads((tmp_path / name / "summary.json").read_text())
                            for name in runs)
    assert plain["goodput"] == {"island-0": 1.0, "island-1": 1.0}
    assert min(first["goodput"].values()) < 1.0
    assert first["simulated_s"] != plain["simulated_s"]
    assert (first["simulated_s"], first["goodput"], first["eval_loss"]) == \
        (second["simulated_s"], second["goodput"], second["eval_loss"])


@pytest.mark.long  # two sims of a minute's CPU: .ci/run runs it after the default tier
def test_sim_with_two_syncer_shards_computes_the_one_syncer_run(tiny_llama, tiny_task,
                                                                tmp_path):
    """`python -m yeto.sim --syncer-shards 2`: two shards in the process (their own state
    dirs, island-0 seeding both), each island pushing each fragment to its owner. With
    blocking sync the islands end with the weights of the same fleet served by one
    syncer (two fragments in both)."""
    args = [*_island_args(tiny_llama, tiny_task), "--islands", "2", "--grace-ms", "0",
            "--fragments", "2"]
    one, two = tmp_path / "one", tmp_path / "two"
    printed = _sims([*args, "--out", one], [*args, "--syncer-shards", "2", "--out", two])
    assert all(p.strip().splitlines()[-1].startswith("RESULT eval_loss=") for p in printed)
    adapter = "islands/island-{}/adapter/adapter_model.safetensors"
    want = load_file(str(one / adapter.format(0)))
    assert max(float(np.abs(want[k]).max()) for k in want if "lora_B" in k) > 0  # trained
    for i in range(2):
        got = load_file(str(two / adapter.format(i)))
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    for s in range(2):  # each shard merged rounds of its own fragment only
        merges = [r for r in read_tape(two / f"syncer-{s}" / "tape.jsonl")
                  if r["event"] == "merge"]
        assert merges and {m["fragment"] for m in merges} == {s}
