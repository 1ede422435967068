"""A standby syncer (`python -m syncer --standby-of`): it holds every committed state as
the primary saves it, and when the primary is killed with SIGKILL it takes the run over;
the islands, which hold both addresses, finish without a restart and no committed round
is lost. Real processes: two syncers and synthetic numpy islands."""

import signal
import subprocess
import sys
from pathlib import Path

from helpers.wait import wait_until

from syncer import spawn, state
from syncer.spawn import SyncerProcess
from syncer.tape import read_tape

ROOT = Path(__file__).resolve().parents[2]
SIM = [sys.executable, "-m", "yeto.testing.synthetic"]
ARGS = ["--quorum", "2", "--grace-ms", "100", "--outer", "nesterov", "--outer-lr", "0.7",
        "--outer-momentum", "0.9", "--token", "s3cret-run"]


def _syncer(state_dir: Path, *args) -> SyncerProcess:
    with open(state_dir.parent / f"{state_dir.name}.log", "a") as log:
        return spawn.start_syncer(["--state-dir", str(state_dir), *ARGS, *args], cwd=ROOT,
                                  log=log)


def _events(state_dir: Path, kind: str) -> list[dict]:
    path = state_dir / "tape.jsonl"
    return [r for r in read_tape(path) if r["event"] == kind] if path.exists() else []


def _island(address: str, lid: str, out: Path) -> subprocess.Popen:
    log = open(out / f"{lid}.log", "a")
    return subprocess.Popen([*SIM, "--syncer", address, "--learner-id", lid, "--token",
                             "s3cret-run", "--record", str(out / f"{lid}.jsonl"), "--steps",
                             "150", "--sync-every", "5", "--step-seconds", "0.02", "--dim",
                             "2048", "--seed", lid[-1]], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT)


def _records(path: Path) -> list[dict]:
    import json

    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_a_standby_takes_over_a_killed_primary_without_losing_a_round(tmp_path):
    a, b = tmp_path / "primary", tmp_path / "standby"
    primary = _syncer(a)
    standby = _syncer(b, "--standby-of", primary.address, "--takeover-after-s", "2")
    procs = [primary, standby]
    try:
        assert wait_until(lambda: _events(a, "standby"), timeout=60), "no standby registered"
        islands = [_island(f"{primary.address},{standby.address}", f"island-{i}", tmp_path)
                   for i in range(2)]
        procs += islands
        assert wait_until(lambda: len(_events(a, "merge")) >= 4, timeout=120)
        primary.send_signal(signal.SIGKILL)
        primary.wait()
        saved = state.load(a)[3]
        held = state.load(b, state.StateKey("s3cret-run"))[3]
        # the standby held the primary's last committed state before anyone saw it
        assert held["version"] == saved["version"] and held["run_id"] == saved["run_id"]
        for p in islands:
            assert p.wait(timeout=300) == 0
        assert standby.wait(timeout=60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    # the takeover is on both tapes: the primary's says the standby registered, the
    # standby's that it took over at the saved version, and its rounds go on from there
    takeover = _events(b, "takeover")
    assert len(takeover) == 1 and takeover[0]["version"] == saved["version"]
    versions = [r["version"] for r in _events(b, "merge")]
    assert versions and versions == list(range(saved["version"] + 1, versions[-1] + 1))
    # no island restarted; both ended with the run's final weights, the same bits
    finals = [[r for r in _records(tmp_path / f"island-{i}.jsonl") if r["event"] == "done"][-1]
              for i in range(2)]
    assert all(f["final"] for f in finals)
    assert finals[0]["weights_sha256"] == finals[1]["weights_sha256"]
    theta_final = state.load(b, state.StateKey("s3cret-run"))[3]
    assert theta_final["version"] == versions[-1]
