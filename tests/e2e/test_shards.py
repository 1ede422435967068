"""A run served by shards (`python -m syncer --shard I/S`): islands push each fragment to
its owner and take broadcasts from every shard, and the run's weights do not depend on
the number of shards, bit for bit. Real processes: syncers and synthetic numpy islands
(blocking sync, so every round holds both islands' pushes whatever the timing)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from syncer import spawn
from syncer.spawn import SyncerProcess

ROOT = Path(__file__).resolve().parents[2]
SIM = [sys.executable, "-m", "yeto.testing.synthetic"]
COMMON = ["--quorum", "2", "--fragments", "2", "--seed-from", "island-0"]


def _syncer(out: Path, name: str, *args) -> SyncerProcess:
    with open(out / f"{name}.log", "a") as log:
        return spawn.start_syncer(["--state-dir", str(out / name), *COMMON, *args], cwd=ROOT,
                                  log=log)


def _islands(out: Path, address: str, wire: str, layout: str) -> list[dict]:
    """Two islands to the end of the run; each one's last record."""
    procs = [subprocess.Popen([*SIM, "--syncer", address, "--learner-id", f"island-{i}",
                               "--record", str(out / f"island-{i}.jsonl"), "--steps", "30",
                               "--sync-every", "5", "--dim", "4096", "--seed", str(i),
                               "--wire", wire, "--layout", layout, "--blocking-sync"], cwd=ROOT,
                              stdout=open(out / f"island-{i}.log", "w"),
                              stderr=subprocess.STDOUT) for i in range(2)]
    for i, p in enumerate(procs):
        assert p.wait(timeout=300) == 0, (out / f"island-{i}.log").read_text()[-3000:]
    return [json.loads((out / f"island-{i}.jsonl").read_text().splitlines()[-1])
            for i in range(2)]


def _run(out: Path, shards: int, wire: str, layout: str) -> list[dict]:
    out.mkdir()
    syncers = [_syncer(out, f"shard{i}", "--shard", f"{i}/{shards}") for i in range(shards)]
    try:
        done = _islands(out, ";".join(s.address for s in syncers), wire, layout)
        for s in syncers:
            assert s.wait(timeout=60) == 0
    finally:
        for s in syncers:
            if s.poll() is None:
                s.kill()
    return done


@pytest.mark.parametrize("wire", ["f32", "q4"])
@pytest.mark.parametrize("layout", ["lora", "full"])
def test_two_shards_end_with_the_weights_of_one_bit_for_bit(tmp_path, wire, layout):
    one = _run(tmp_path / "one", 1, wire, layout)
    two = _run(tmp_path / "two", 2, wire, layout)
    for done in (one, two):
        assert all(d["event"] == "done" and d["final"] for d in done), done
        assert done[0]["weights_sha256"] == done[1]["weights_sha256"]
    assert one[0]["weights_sha256"] == two[0]["weights_sha256"]
    # each shard ran the rounds of its own fragment only
    for i in range(2):
        tape = [json.loads(x) for x in (tmp_path / "two" / f"shard{i}" / "tape.jsonl")
                .read_text().splitlines()]
        assert {r["fragment"] for r in tape if r["event"] == "merge"} == {i}


def test_a_wrong_shard_map_is_refused_with_one_clear_line(tmp_path):
    """Shards listed out of order: the island stops at its first join, naming it."""
    out = tmp_path / "run"
    out.mkdir()
    syncers = [_syncer(out, f"shard{i}", "--shard", f"{i}/2") for i in range(2)]
    try:
        p = subprocess.run([*SIM, "--syncer", f"{syncers[1].address};{syncers[0].address}",
                            "--learner-id", "island-0", "--steps", "5", "--dim", "64"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        for s in syncers:
            s.kill()
    assert p.returncode != 0
    assert "wrong shard map" in p.stdout + p.stderr


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_a_shard_never_holds_the_whole_seed(tmp_path):
    """Each shard received the seed whole into one buffer before keeping its own
    fragments: at S shards every one of them briefly held all of Θ (S x its part).
    Now a shard keeps its part as the bytes arrive: a 200 MB seed raises a shard of
    two by about its 100 MB half, not the 300 MB of the whole seed beside its half.
    Memory, read from /proc (VmHWM), not time."""
    import numpy as np

    from yeto.client.sharded import ShardedClient
    from yeto.layout import Layout

    layout = Layout.from_shapes({"base_model.model.m.q_proj.lora_A.weight": (2500, 10_000),
                                 "base_model.model.m.q_proj.lora_B.weight": (10_000, 2500)})
    seed = np.ones(layout.numel, np.float32)  # 5e7 values: 200 MB
    shards = [spawn.start_syncer(["--quorum", "1", "--fragments", "2", "--shard", f"{i}/2"],
                                 cwd=ROOT, log=tmp_path / f"shard-{i}.log") for i in range(2)]
    client = None
    try:
        before = _kib(shards[0].pid, "VmRSS")
        client = ShardedClient(";".join(s.address for s in shards), "island-0", layout,
                               backoff_s=0.05, max_backoff_s=0.2)
        client.start(seed)
        seeded: set[int] = set()  # the fragments broadcast at version 0: both shards seeded
        while len(seeded) < 2:
            got = client.wait(timeout=120)
            assert got, client.last_error
            seeded |= {r.fragment for r in got if r.version == 0}
        grew = (_kib(shards[0].pid, "VmHWM") - before) * 1024
    finally:
        if client is not None:
            client.close()
        for s in shards:
            s.kill()
            s.wait()
    assert grew < 0.75 * seed.nbytes, f"the shard's peak grew by {grew / 1e6:.0f} MB"
