"""Faults and bad input: auth, TLS, state and --resume, rejoin, validation, clipping.

Process tests run the real syncer (`python -m syncer`) and synthetic numpy islands
(`yeto.testing.synthetic`) as subprocesses and kill them with SIGKILL.

Here: the checks that need real processes (the others: tests/integration/test_faults.py)."""


import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from helpers.syncer import make_client
from helpers.wait import wait_until

from syncer import spawn, state
from syncer.run import Config, Run
from syncer.spawn import SyncerProcess
from syncer.tape import read_tape
from yeto import codec, net
from yeto.proto import yeto_pb2 as pb
from yeto.proto import yeto_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]


SIM = [sys.executable, "-m", "yeto.testing.synthetic"]


# ---- helpers ------------------------------------------------------------------
def start_syncer(state_dir: Path, *args, port: int = 0) -> SyncerProcess:
    """A syncer process on `port` (0: any), its output appended to syncer.log beside
    the state dir (restarts of one run share the log)."""
    with open(state_dir.parent / "syncer.log", "a") as log:
        return spawn.start_syncer(["--state-dir", str(state_dir), *args], port=port, cwd=ROOT,
                                  log=log)


def start_island(address: str, lid: str, record: Path, *args) -> subprocess.Popen:
    log = open(record.with_suffix(".log"), "a")
    return subprocess.Popen([*SIM, "--syncer", address, "--learner-id", lid,
                             "--record", str(record), *args], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT)


def merges(state_dir: Path) -> list[dict]:
    path = state_dir / "tape.jsonl"
    return [r for r in read_tape(path) if r["event"] == "merge"] if path.exists() else []


def _log(record: Path) -> str:
    path = record.with_suffix(".log")
    return path.read_text(errors="replace") if path.exists() else ""


def records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


# ---- processes killed with signals ------------------------------------------------
def test_killed_island_restarts_rejoins_and_run_completes(tmp_path):
    sd = tmp_path / "state"
    syncer = start_syncer(sd, "--quorum", "2", "--grace-ms", "100")
    common = ["--steps", "120", "--sync-every", "5", "--step-seconds", "0.02", "--dim", "2048"]
    recs = {i: tmp_path / f"island-{i}.jsonl" for i in range(3)}
    islands = {i: start_island(syncer.address, f"island-{i}", recs[i], *common, "--seed", str(i))
               for i in range(3)}
    try:
        assert wait_until(lambda: len(merges(sd)) >= 3, timeout=120)
        islands[2].send_signal(signal.SIGKILL)
        islands[2].wait()
        killed_at = len(merges(sd))
        # the others carry on at quorum 2 without it
        assert wait_until(lambda: len(merges(sd)) >= killed_at + 3, timeout=120)
        islands[2] = start_island(syncer.address, "island-2", recs[2], *common, "--seed", "2")
        for p in islands.values():
            assert p.wait(timeout=300) == 0
        assert syncer.wait(timeout=60) == 0
    finally:
        for p in [*islands.values(), syncer]:
            if p.poll() is None:
                p.kill()
    tape = merges(sd)
    who = [{x["learner"] for x in r["responders"]} for r in tape]
    assert "island-2" in set().union(*who[:3])
    gap = [i for i, w in enumerate(who) if i >= killed_at and "island-2" not in w]
    back = [i for i, w in enumerate(who) if i > killed_at + 2 and "island-2" in w]
    assert gap and back, who  # absent after the kill, back in later rounds
    assert [r["version"] for r in tape] == list(range(1, len(tape) + 1))
    finals = {i: [r for r in records(recs[i]) if r["event"] == "done"][-1] for i in recs}
    assert all(f["final"] for f in finals.values())
    assert len({f["weights_sha256"] for f in finals.values()}) == 1  # bit-identical


def test_killed_syncer_resumes_without_losing_a_round(tmp_path):
    sd = tmp_path / "state"
    args = ["--quorum", "2", "--grace-ms", "100", "--outer", "nesterov", "--outer-lr", "0.7",
            "--outer-momentum", "0.9"]
    syncer = start_syncer(sd, *args)
    common = ["--steps", "150", "--sync-every", "5", "--step-seconds", "0.02", "--dim", "2048"]
    recs = {i: tmp_path / f"island-{i}.jsonl" for i in range(2)}
    islands = [start_island(syncer.address, f"island-{i}", recs[i], *common, "--seed", str(i))
               for i in range(2)]
    try:
        assert wait_until(lambda: len(merges(sd)) >= 4, timeout=120)
        syncer.send_signal(signal.SIGKILL)
        syncer.wait()
        _, _, _, saved = state.load(sd)
        # the islands notice, back off and keep training locally
        assert wait_until(lambda: all("unreachable" in _log(recs[i]) for i in recs), timeout=60)
        # a restart without --resume refuses to overwrite the saved run
        r = subprocess.run([sys.executable, "-m", "syncer", "--port", "0", "--state-dir",
                            str(sd)], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "--resume" in r.stderr
        syncer = start_syncer(sd, *args, "--resume", port=syncer.port)
        for p in islands:
            assert p.wait(timeout=300) == 0
        assert syncer.wait(timeout=60) == 0
    finally:
        for p in [*islands, syncer]:
            if p.poll() is None:
                p.kill()
    tape = merges(sd)
    versions = [r["version"] for r in tape]
    # the round counter continues from the saved state: no committed round lost or repeated
    assert versions == list(range(1, len(tape) + 1)) and len(tape) > saved["version"]
    # state exactly: the Θ islands applied at the saved version is the saved Θ (an island
    # gets it before the kill or from the resumed syncer; one may skip it if the next
    # round commits first, but not both)
    held = {i: r["theta_sha256"] for i in recs for r in records(recs[i])
            if r["event"] == "applied" and r["version"] == saved["version"]}
    assert held, f"no island applied the saved version {saved['version']}"
    assert set(held.values()) == {saved["theta_sha256"]}
    finals = [[r for r in records(recs[i]) if r["event"] == "done"][-1] for i in recs]
    assert all(f["final"] for f in finals) and finals[0]["weights_sha256"] == \
        finals[1]["weights_sha256"]
    assert "resumed run" in (tmp_path / "syncer.log").read_text()


def test_syncer_killed_mid_push_merges_nothing_partial(tmp_path):
    """A push half streamed when the syncer dies is gone; the resumed state is the saved one.

    The push is held open after its first chunks, and the kill waits for proof that its
    bytes reached the syncer: the syncer has read and checked the push's first chunk
    (header and 1 MiB of payload) once its Status shows the pushing island's contact
    after the push began (that island joined without a subscription, so nothing else
    touches its contact time), while its bytes-in still lack the push (not complete)."""
    from yeto.layout import Layout

    big = Layout.from_shapes({"w.layers.0.a": (2048, 2048)})  # 16 MiB in f32: 16 chunks
    sd = tmp_path / "state"
    syncer = start_syncer(sd, "--quorum", "1")
    c = make_client(syncer.address, "a", big)
    c.start(np.zeros(big.numel, np.float32))
    assert c.wait_one(timeout=60).version == 0
    assert c.push(codec.encode(np.ones(big.numel, np.float32), "f32"), encoding="f32",
                  base_version=0, loss_tokens=1, steps=1, seq=0).result(60).accepted
    assert c.wait_one(timeout=60).version == 1
    _, _, _, before = state.load(sd)
    channel = grpc.insecure_channel(syncer.address, options=net.GRPC_OPTIONS)
    stub = pb_grpc.SyncerStub(channel)
    gen = stub.Join(pb.JoinRequest(
        learner_id="b", fingerprint=big.fingerprint, backend="numpy",
        weights_file="w.safetensors", layout=[pb.TensorSpec(name=s.name, shape=list(s.shape),
                                                             dtype=s.dtype) for s in big.specs]),
        timeout=30).generation
    bytes_in = status(syncer.address)["bytes_in"]
    release = threading.Event()
    t0 = time.monotonic()
    assert not _contact_since(syncer.address, "b", t0)  # nothing from "b" since its join
    fut = stub.Push.future(_held_push(big, gen, release, chunks=2), timeout=120)
    try:
        assert wait_until(lambda: _contact_since(syncer.address, "b", t0), timeout=60)
        assert status(syncer.address)["bytes_in"] == bytes_in  # the push is not complete
        syncer.kill()
    finally:
        release.set()
    with pytest.raises(grpc.RpcError):
        fut.result(60)
    channel.close()
    c.close()
    theta, _, _, after = state.load(sd)
    assert after["version"] == 1 and after["theta_sha256"] == before["theta_sha256"]
    np.testing.assert_allclose(theta, -np.ones(big.numel, np.float32), atol=1e-6)  # lr 1, μ 0


def _held_push(layout, generation: int, release: threading.Event, chunks: int):
    """The chunks of a valid push from "b", of which only the first `chunks` are sent
    before `release` (then the stream ends short)."""
    payload = codec.encode(np.full(layout.numel, 5.0, np.float32), "f32")
    header = pb.PushHeader(learner_id="b", generation=generation, round=2, base_version=1,
                           loss_tokens=1, steps=1, encoding="f32", numel=layout.numel,
                           payload_bytes=len(payload), kind=pb.DELTA, seq=0)
    for i, piece in enumerate(net.chunks(payload)):
        if i == chunks:
            release.wait(120)
            return
        yield pb.PushChunk(header=header if i == 0 else None, data=bytes(piece))


def status(address: str) -> dict:
    from yeto.cli.status import fetch

    return fetch(address, timeout=10)


def _contact_since(address: str, learner: str, t0: float) -> bool:
    """True once the syncer heard from `learner` after monotonic time `t0` (the Status
    reply's "seconds since last contact" is measured after `asked`, so a value below
    asked - t0 means a contact after t0)."""
    asked = time.monotonic()
    islands = {i["learner_id"]: i for i in status(address)["islands"]}
    return islands[learner]["last_contact_s"] < asked - t0


# ---- TLS ------------------------------------------------------------------------------------
def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def certs(tmp_path):
    if not shutil_which("openssl"):
        pytest.skip("openssl not installed")
    d = tmp_path / "pki"
    d.mkdir()
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.pem", "-days", "2", "-subj", "/CN=yeto-test-ca", cwd=d)
    for name, san in (("server", "IP:127.0.0.1,DNS:localhost"), ("client", "DNS:island"),
                      ("mallory", "DNS:mallory")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                 f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile",
                 f"{name}.ext", cwd=d)
    return d


def shutil_which(x):
    import shutil

    return shutil.which(x)


def test_tls_and_mutual_tls(certs, toy_layout):
    from syncer.service import serve
    from yeto.client import TLSConfig

    read = lambda n: (certs / n).read_bytes()  # noqa: E731
    for mutual in (False, True):
        run = Run(Config(quorum=1))
        server, port = serve(run, "127.0.0.1", 0, tls=(read("server.pem"), read("server.key"),
                                                       read("ca.pem") if mutual else None))
        try:
            addr = f"127.0.0.1:{port}"
            tls = TLSConfig(ca=read("ca.pem"), cert=read("client.pem") if mutual else None,
                            key=read("client.key") if mutual else None)
            ok = make_client(addr, "island", toy_layout, tls=tls)  # its certificate's name
            ok.start(np.zeros(toy_layout.numel, np.float32))
            assert ok.wait_one(timeout=20).version == 0
            ok.close()
            # plaintext against a TLS port never joins
            plain = make_client(addr, "b", toy_layout)
            plain.start(np.zeros(toy_layout.numel, np.float32))
            assert plain.wait_one(timeout=2) is None and "b" not in run.members.rows
            plain.close()
            if mutual:  # no client certificate: refused
                anon = make_client(addr, "c", toy_layout, tls=TLSConfig(ca=read("ca.pem")))
                anon.start(np.zeros(toy_layout.numel, np.float32))
                assert anon.wait_one(timeout=2) is None and "c" not in run.members.rows
                anon.close()
        finally:
            server.ticker_stop.set()
            server.stop(0).wait()


def test_a_client_certificate_acts_only_for_the_island_it_names(certs, toy_layout, tmp_path):
    """Under mutual TLS without a token any certificate the CA had signed could join,
    push, subscribe and heartbeat as any learner id (issue 44). Now a call may act only
    for an id its certificate names (CN or subjectAltName): else PERMISSION_DENIED,
    taped, and the island keeps its place."""
    from syncer.service import serve
    from yeto.client import TLSConfig

    read = lambda n: (certs / n).read_bytes()  # noqa: E731
    run = Run(Config(quorum=1, state_dir=tmp_path / "s"))
    server, port = serve(run, "127.0.0.1", 0, tls=(read("server.pem"), read("server.key"),
                                                   read("ca.pem")))
    addr, n = f"127.0.0.1:{port}", toy_layout.numel
    try:
        island = make_client(addr, "island", toy_layout, tls=TLSConfig(
            ca=read("ca.pem"), cert=read("client.pem"), key=read("client.key")))
        island.start(np.zeros(n, np.float32))
        assert island.wait_one(timeout=30) is not None, island.last_error
        gen = run.members.rows["island"].generation
        creds = grpc.ssl_channel_credentials(read("ca.pem"), read("mallory.key"),
                                             read("mallory.pem"))
        with grpc.secure_channel(addr, creds, options=net.GRPC_OPTIONS) as ch:
            stub = pb_grpc.SyncerStub(ch)
            join = pb.JoinRequest(learner_id="island", fingerprint=toy_layout.fingerprint,
                                  layout=[pb.TensorSpec(name=s.name, shape=list(s.shape),
                                                        dtype=s.dtype)
                                          for s in toy_layout.specs])
            header = pb.PushHeader(learner_id="island", generation=gen, round=1,
                                   base_version=0, loss_tokens=1, steps=1, encoding="f32",
                                   numel=n, payload_bytes=4 * n, seq=0)
            calls = [
                lambda: stub.Join(join, timeout=20),
                lambda: stub.Push(iter([pb.PushChunk(header=header, data=bytes(4 * n))]),
                                  timeout=20),
                lambda: stub.Heartbeat(pb.HeartbeatRequest(learner_id="island",
                                                           generation=gen), timeout=20),
                lambda: next(stub.Subscribe(pb.SubscribeRequest(learner_id="island",
                                                                generation=gen), timeout=20)),
            ]
            for call in calls:
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value.details()
                assert "'mallory'" in e.value.details() and "CN" in e.value.details()
            assert run.members.rows["island"].generation == gen and run.version == 0
            join.learner_id = "mallory"  # its own name: admitted
            assert stub.Join(join, timeout=20).generation > 0
        island.close()
    finally:
        server.ticker_stop.set()
        server.stop(0).wait()
        run.tape.close()
    denied = [r for r in read_tape(tmp_path / "s" / "tape.jsonl")
              if r["event"] == "rejected" and r["kind"].endswith(":denied")]
    assert {r["learner"] for r in denied} == {"mallory"} and len(denied) == 4


def test_refuses_public_address_without_token_or_tls():
    r = subprocess.run([sys.executable, "-m", "syncer", "--host", "0.0.0.0", "--port", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if k != net.TOKEN_ENV})
    assert r.returncode != 0 and "--insecure" in r.stderr and "YETO_TOKEN" in r.stderr
