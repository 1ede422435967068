"""A standby syncer (`python -m syncer --standby-of`): it holds every committed state as
the primary saves it, and when the primary is killed with SIGKILL it takes the run over;
the islands, which hold both addresses, finish without a restart and no committed round
is lost. Real processes: two syncers and synthetic numpy islands."""

import contextlib
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
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


@contextlib.contextmanager
def _pair_with_islands(tmp_path: Path, merges: int):
    """A primary (state dir tmp_path/primary) and its standby (tmp_path/standby), and two
    islands holding both addresses, once the primary committed `merges` rounds: yields
    (primary, standby, islands); every process still running at the end is killed."""
    a, b = tmp_path / "primary", tmp_path / "standby"
    primary = _syncer(a)
    standby = _syncer(b, "--standby-of", primary.address, "--takeover-after-s", "2")
    procs = [primary, standby]
    try:
        assert wait_until(lambda: _events(a, "standby"), timeout=60), "no standby registered"
        islands = [_island(f"{primary.address},{standby.address}", f"island-{i}", tmp_path)
                   for i in range(2)]
        procs += islands
        assert wait_until(lambda: len(_events(a, "merge")) >= merges, timeout=120)
        yield primary, standby, islands
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)  # (a stopped process ends only once woken)
                p.kill()


def test_a_standby_takes_over_a_killed_primary_without_losing_a_round(tmp_path):
    a, b = tmp_path / "primary", tmp_path / "standby"
    with _pair_with_islands(tmp_path, merges=4) as (primary, standby, islands):
        primary.send_signal(signal.SIGKILL)
        primary.wait()
        saved = state.load(a)[3]
        held = state.load(b, state.StateKey("s3cret-run"))[3]
        # the standby held the primary's last committed state before anyone saw it
        assert held["version"] == saved["version"] and held["run_id"] == saved["run_id"]
        for p in islands:
            assert p.wait(timeout=300) == 0
        assert standby.wait(timeout=60) == 0
    # the takeover is on both tapes: the primary's says the standby registered, the
    # standby's that it took over at the saved version, and its rounds go on from there
    takeover = _events(b, "takeover")
    assert len(takeover) == 1 and takeover[0]["version"] == saved["version"]
    assert takeover[0]["term"] == 1 and held_term(b) == 1  # on disk before it served
    versions = [r["version"] for r in _events(b, "merge")]
    assert versions and versions == list(range(saved["version"] + 1, versions[-1] + 1))
    # no island restarted; both ended with the run's final weights, the same bits
    finals = [[r for r in _records(tmp_path / f"island-{i}.jsonl") if r["event"] == "done"][-1]
              for i in range(2)]
    assert all(f["final"] for f in finals)
    assert finals[0]["weights_sha256"] == finals[1]["weights_sha256"]
    theta_final = state.load(b, state.StateKey("s3cret-run"))[3]
    assert theta_final["version"] == versions[-1]


def held_term(state_dir: Path) -> int:
    return int(state.load(state_dir, state.StateKey("s3cret-run"))[3].get("term", 0))


@pytest.mark.long  # about a minute: the islands notice a frozen primary by keepalive
def test_a_frozen_primary_that_wakes_after_the_takeover_is_fenced(tmp_path):
    """Split brain: the primary is frozen (SIGSTOP) long enough for its standby to take
    the run over (term 1) and the islands to finish there; then it wakes (SIGCONT),
    still a primary at term 0 with an older state. The first island that joins it
    carries term 1: the old primary refuses it as unavailable (the island moves on),
    tapes "fenced" and exits non-zero, committing nothing more. Before terms it served
    on beside the new primary."""
    import grpc

    from yeto import net
    from yeto.proto import yeto_pb2 as pb
    from yeto.proto import yeto_pb2_grpc as pb_grpc

    a, b = tmp_path / "primary", tmp_path / "standby"
    with _pair_with_islands(tmp_path, merges=3) as (primary, standby, islands):
        primary.send_signal(signal.SIGSTOP)
        for p in islands:  # they moved to the standby and finished the run there
            assert p.wait(timeout=300) == 0
        assert held_term(b) == 1 and _events(b, "takeover")[0]["term"] == 1
        primary.send_signal(signal.SIGCONT)
        stale = state.load(a)[3]
        assert int(stale.get("term", 0)) == 0
        md = net.auth_metadata(net.credential_for("s3cret-run", "island-0"))
        signed = net.term_proof("s3cret-run", stale["run_id"], 1)  # what the new primary hands out
        with grpc.insecure_channel(primary.address) as ch:
            stub = pb_grpc.SyncerStub(ch)
            with pytest.raises(grpc.RpcError) as forged:  # a term an island made up
                stub.Join(pb.JoinRequest(learner_id="island-0", known_term=1,
                                         term_proof=bytes(32)), metadata=md, timeout=30)
            assert forged.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert primary.poll() is None  # it fenced nothing
            with pytest.raises(grpc.RpcError) as refused:
                stub.Join(pb.JoinRequest(learner_id="island-0", known_term=1,
                                         term_proof=signed), metadata=md, timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "fenced" in refused.value.details()
        assert primary.wait(timeout=60) != 0
        assert state.load(a)[3]["version"] == stale["version"]  # it committed nothing more
        fenced = _events(a, "fenced")
        assert len(fenced) == 1 and fenced[0]["term"] == 1 and fenced[0]["own_term"] == 0


def _self_signed(d: Path) -> tuple[Path, Path]:
    """One certificate both syncers serve (it names 127.0.0.1), which islands trust."""
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    "syncer.key", "-out", "syncer.pem", "-days", "2", "-subj", "/CN=syncer",
                    "-addext", "subjectAltName=IP:127.0.0.1"], cwd=d, check=True,
                   capture_output=True)
    return d / "syncer.pem", d / "syncer.key"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_a_standby_pair_speaks_tls_both_ways(tmp_path, toy_layout):
    """A TLS run can have a standby: it registers with the primary over TLS, and the
    primary sends it each committed state over TLS (the standby serves the same
    certificate; the run's --token authenticates both calls). Before, --standby-of
    refused TLS flags."""
    import numpy as np
    from helpers.syncer import make_client, push_delta, wait_version

    from yeto.client.connection import TLSConfig

    cert, key = _self_signed(tmp_path)
    tls = ["--tls-cert", str(cert), "--tls-key", str(key), "--quorum", "1"]
    a, b = tmp_path / "primary", tmp_path / "standby"
    primary = _syncer(a, *tls)
    standby = _syncer(b, *tls, "--standby-of", primary.address, "--takeover-after-s", "600")
    client = None
    try:
        assert wait_until(lambda: _events(a, "standby"), timeout=60), (
            "the standby did not register over TLS: " + (tmp_path / "standby.log").read_text())
        client = make_client(primary.address, "island-0", toy_layout, token="s3cret-run",
                             tls=TLSConfig(ca=cert.read_bytes()))
        client.start(np.zeros(toy_layout.numel, np.float32))
        assert client.connected.wait(30), client.last_error
        assert wait_version(client, 0) is not None  # Θ seeded and broadcast
        assert push_delta(client, np.full(toy_layout.numel, 0.01, np.float32), 10, 0, 0).accepted

        def held() -> int:
            try:
                return int(state.load(b, state.StateKey("s3cret-run"))[3]["version"])
            except (state.StateError, OSError):
                return 0

        assert wait_until(lambda: held() >= 1, timeout=60), (
            "no state reached the standby over TLS: " + (tmp_path / "primary.log").read_text())
        assert held() == state.load(a, state.StateKey("s3cret-run"))[3]["version"]
    finally:
        if client is not None:
            client.close()
        for p in (primary, standby):
            p.kill()
            p.wait()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_a_tls_standby_needs_the_run_token(tmp_path):
    cert, key = _self_signed(tmp_path)
    out = subprocess.run([sys.executable, "-m", "syncer", "--state-dir", str(tmp_path / "s"),
                          "--tls-cert", str(cert), "--tls-key", str(key), "--standby-of",
                          "127.0.0.1:1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "--standby-of with TLS needs the run's --token" in out.stderr


def test_a_standby_stops_when_its_primary_finishes_the_run(tmp_path):
    """A standby took a finished run over: once the primary exited after the last
    round, the standby heard silence, resumed the run and served it with no island
    left, forever. Now the primary's reply tells it the run finished (and the primary
    waits, a few seconds at most, until it has): both exit 0, and nobody takes over."""
    a, b = tmp_path / "primary", tmp_path / "standby"
    primary = _syncer(a, "--quorum", "1")
    standby = _syncer(b, "--quorum", "1", "--standby-of", primary.address,
                      "--takeover-after-s", "1")
    island = None
    try:
        assert wait_until(lambda: _events(a, "standby"), timeout=60), "no standby registered"
        island = subprocess.run([*SIM, "--syncer", f"{primary.address},{standby.address}",
                                 "--learner-id", "island-0", "--token", "s3cret-run",
                                 "--steps", "20", "--sync-every", "5", "--dim", "256"],
                                cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert island.returncode == 0, island.stdout[-2000:] + island.stderr[-2000:]
        assert primary.wait(timeout=60) == 0
        assert standby.wait(timeout=60) == 0, (tmp_path / "standby.log").read_text()[-2000:]
    finally:
        for p in (primary, standby):
            if p.poll() is None:
                p.kill()
    assert not _events(b, "takeover")
    assert "finished the run at version" in (tmp_path / "standby.log").read_text()
