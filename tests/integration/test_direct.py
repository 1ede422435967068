"""The direct downlink (`yeto.wire`, `syncer.direct`): broadcasts on a plain TCP port,
sent from Θ's memory. Same bytes as Subscribe, the same checks at its door, no commit
held up and no copy of Θ kept by a reader that stalls, and a fallback to gRPC where the
port cannot be reached. Through real in-process syncers on loopback."""

import socket
import threading

import grpc
import numpy as np
import pytest
from helpers.syncer import AVERAGING, make_client, push_delta, running_syncer, wait_version

from integration.test_trust import SECRET, _cred, _join, _started, _stub
from integration.test_trust_streams import _kept_copies
from syncer.broadcast import Downlink, Source
from syncer.run import Config, Run
from syncer.service import serve
from syncer.tape import read_tape
from yeto import wire
from yeto.client.direct import DirectReader, StatusError
from yeto.layout import Layout
from yeto.proto import yeto_pb2 as pb


def _run_rounds(layout, downlink, direct_port, rounds=3, seed=0):
    """Two islands, `rounds` rounds of fixed pushes; every broadcast each receives, as
    bytes, and whether each read them on the direct port."""
    rng = np.random.default_rng(seed)
    n = layout.numel
    init = rng.standard_normal(n).astype(np.float32)
    deltas = [[rng.standard_normal(n).astype(np.float32) * 0.1 for _ in range(2)]
              for _ in range(rounds)]
    got: list[list[bytes]] = [[], []]
    with running_syncer(quorum=2, downlink=downlink, direct_port=direct_port,
                        **AVERAGING) as (run, addr):
        cs = [make_client(addr, f"i{k}", layout) for k in range(2)]
        for c in cs:
            c.start(init)
        for k, c in enumerate(cs):
            got[k].append(wait_version(c, 0).theta.tobytes())
        for r in range(rounds):
            for k, c in enumerate(cs):
                push_delta(c, deltas[r][k], 10 + k, r, r, encoding="q4")
            for k, c in enumerate(cs):
                got[k].append(wait_version(c, r + 1).theta.tobytes())
        direct = [c.connection.via_direct for c in cs]
        for c in cs:
            c.close()
    return got, direct


@pytest.mark.parametrize("downlink", ["f32", "q4"])
def test_the_direct_downlink_sends_what_grpc_sends(downlink):
    """Every version each island holds is the same, bit for bit, read on the direct
    port or over Subscribe: whole f32 weights, and the q4 updates of a compressed
    downlink (added to what the island holds)."""
    layout = Layout.from_shapes({"w.lora_A.weight": (3000, 1000)})  # 12 MB: many pieces
    direct, via = _run_rounds(layout, downlink, direct_port=0)
    grpc_, via_grpc = _run_rounds(layout, downlink, direct_port=None)
    assert via == [True, True] and via_grpc == [False, False]
    assert direct == grpc_
    assert direct[0] == direct[1] and len(direct[0]) == 4


def _hello(learner, generation, credential, run_id):
    return wire.direct_hello(pb.DirectHello(
        learner_id=learner, generation=generation, run_id=run_id,
        authorization=f"Bearer {credential}" if credential else ""))


def _answer(port: int, raw: bytes) -> tuple[int, bytes] | None:
    """The first frame the direct port answers `raw` with (None: it closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(raw)
        try:
            return wire.read_frame(s)
        except ConnectionError:
            return None


def test_the_direct_port_checks_who_asks(toy_layout, tmp_path):
    """The direct port admits what Subscribe admits: a missing or forged credential is
    refused (UNAUTHENTICATED), another island's credential too (PERMISSION_DENIED, on
    the tape), so are a stale generation, another run's id and bytes that are no hello
    (closed, nothing sent); the island's own hello gets its broadcast."""
    with running_syncer(quorum=1, token=SECRET, secret=SECRET,
                        state_dir=tmp_path / "s") as (run, addr):
        a, = _started(addr, toy_layout, ["a"])  # seeds Θ
        o = _join(_stub(addr), toy_layout, "o", _cred("o"), observer=True)
        port = o.direct_port
        assert port
        wrong = [
            (_hello("o", o.generation, None, o.run_id), "UNAUTHENTICATED"),
            (_hello("o", o.generation, "isl1:o:" + "0" * 64, o.run_id), "UNAUTHENTICATED"),
            (_hello("o", o.generation, _cred("mallory"), o.run_id), "PERMISSION_DENIED"),
            (_hello("o", o.generation + 7, _cred("o"), o.run_id), "FAILED_PRECONDITION"),
            (_hello("o", o.generation, _cred("o"), "another-run"), "FAILED_PRECONDITION"),
        ]
        for raw, code in wrong:
            frame = _answer(port, raw)
            assert frame is not None and frame[0] == wire.FRAME_ERROR, (code, frame)
            assert pb.DirectError.FromString(frame[1]).code == code
        assert _answer(port, b"GET / HTTP/1.1\r\n\r\n") is None
        assert _answer(port, wire.DIRECT_MAGIC + (1 << 30).to_bytes(4, "little")) is None
        frame = _answer(port, _hello("o", o.generation, _cred("o"), o.run_id))
        assert frame is not None and frame[0] == wire.FRAME_HEADER
        header = pb.BroadcastHeader.FromString(frame[1])
        assert header.version == 0 and header.payload_bytes == 4 * toy_layout.numel
        a.close()
    denied = [r for r in read_tape(tmp_path / "s" / "tape.jsonl")
              if r["event"] == "rejected" and r["kind"] == "subscribe:denied"]
    assert [r["learner"] for r in denied] == ["mallory"]


def _read_to_end(s: socket.socket) -> bytes:
    out = bytearray()
    while chunk := s.recv(1 << 20):
        out += chunk
    return bytes(out)


def test_stalled_direct_readers_hold_up_no_commit_and_keep_few_copies(rng):
    """Direct readers that say hello, read their broadcast's header and stall, one per
    version: the commits go on (a commit's `Source.detach` waits only for sends in
    progress, each one non-blocking), the syncer keeps at most `Downlink.KEPT` older
    versions for them, the reader of an older one is ended (its connection closes
    mid-broadcast), and the kept ones get their version's exact bytes."""
    layout = Layout.from_shapes({"w.lora_A.weight": (1 << 17, 64)})  # 32 MiB: more than
    n, stalled = layout.numel, Downlink.KEPT + 1            # the sockets' buffers hold
    with running_syncer(quorum=1) as (run, addr):
        a = make_client(addr, "a", layout)
        a.start(rng.standard_normal(n).astype(np.float32))
        thetas = [wait_version(a, 0).theta.tobytes()]
        joined = _join(_stub(addr), layout, "reader", None, observer=True)
        readers = []
        for v in range(stalled):
            s = socket.create_connection(("127.0.0.1", joined.direct_port), timeout=120)
            s.sendall(_hello("reader", joined.generation, None, joined.run_id))
            kind, body = wire.read_frame(s)
            header = pb.BroadcastHeader.FromString(body)
            assert kind == wire.FRAME_HEADER and header.version == v
            readers.append(s)
            push_delta(a, rng.standard_normal(n).astype(np.float32) * 1e-3, 3, v, v)
            thetas.append(wait_version(a, v + 1, timeout=120).theta.tobytes())
        copies = _kept_copies()
        assert len(copies) <= Downlink.KEPT and sum(copies) <= Downlink.KEPT * 4 * n, copies
        assert len(_read_to_end(readers[0])) < 4 * n  # ended mid-broadcast
        for v in range(1, stalled):  # the kept ones: each its own version, bit for bit
            assert bytes(wire.read_exact(readers[v], 4 * n)) == thetas[v]
        for s in readers:
            s.close()
        a.close()


class _Impostor:
    """Another service on a port: answers every connection with an HTTP error."""

    def __init__(self, port: int):
        self.sock = socket.create_server(("127.0.0.1", port))
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    def close(self):
        self.sock.close()


@pytest.mark.parametrize("behind", ["nothing", "another service"])
def test_an_unusable_direct_port_falls_back_to_grpc(toy_layout, behind):
    """Join replies name a direct port that refuses connections (as behind a firewall),
    or where another service answers (a tunnelled or forwarded address): the islands
    read their broadcasts over Subscribe instead, every round."""
    n = toy_layout.numel
    run = Run(Config(quorum=2, **AVERAGING))
    server, port = serve(run, "127.0.0.1", 0)
    addr, impostor = f"127.0.0.1:{port}", None
    try:
        offered = server.direct.port
        server.direct.stop()
        if behind == "another service":
            impostor = _Impostor(offered)
        cs = [make_client(addr, f"i{k}", toy_layout) for k in range(2)]
        for c in cs:
            c.start(np.zeros(n, np.float32))
        for c in cs:
            assert wait_version(c, 0) is not None
        for k, c in enumerate(cs):
            push_delta(c, np.full(n, 1.0 + k, np.float32), 10, 0, 0)
        for c in cs:
            got = wait_version(c, 1)
            assert got is not None and np.allclose(got.theta, -1.5)
            assert c.connection.direct_port == offered and not c.connection.via_direct
            if impostor is not None:  # it answered, and was told apart from a syncer
                assert "something else" in (c.connection.last_error or ""), \
                    c.connection.last_error
            c.close()
    finally:
        if impostor is not None:
            impostor.close()
        server.ticker_stop.set()
        server.stop(grace=0).wait()


def test_detach_waits_for_a_send_from_the_live_weights():
    """A commit's `Source.detach` returns only once a direct send that has a view of the
    live weights is done with it: the outer step that follows cannot change bytes the
    kernel is still copying. The sink here copies a piece only when told to; the step
    waits for `detach`; every byte the sink gets is the version it started."""
    theta = np.arange(3 * Source.PIECE // 4, dtype=np.float32)
    old = theta.tobytes()
    src = Source(theta)
    reader = src.open()
    in_send, go, stepped = threading.Event(), threading.Event(), threading.Event()
    received = bytearray()

    class Sink:
        def send_some(self, view):
            if not in_send.is_set():
                in_send.set()
                go.wait(60)
            received.extend(view)
            return len(view)

        def wait_writable(self):
            pass

    def step():
        src.detach()
        theta[:] = -1.0  # the outer step writes the weights
        stepped.set()

    sender = threading.Thread(target=src.stream_to, args=(reader, Sink()))
    sender.start()
    assert in_send.wait(60)
    stepper = threading.Thread(target=step)
    stepper.start()
    assert not stepped.wait(1.0)  # (detach still waits: the send has its view)
    go.set()
    sender.join(60)
    stepper.join(60)
    assert stepped.is_set() and bytes(received) == old


def test_a_quiet_stream_is_pinged_and_a_silent_syncer_given_up(toy_layout):
    """Between broadcasts the syncer pings a direct stream (its kernel would answer TCP
    keepalive even frozen, so the island could not tell): a reader whose hello asks
    for a 1 s keepalive gets ping frames while no version comes. An island's reader
    facing a port that accepts and then says nothing gives up (UNAVAILABLE: it joins
    again) instead of waiting for ever."""
    with running_syncer(quorum=1) as (run, addr):
        a = make_client(addr, "a", toy_layout)
        a.start(np.zeros(toy_layout.numel, np.float32))
        wait_version(a, 0)
        o = _join(_stub(addr), toy_layout, "o", None, observer=True)
        with socket.create_connection(("127.0.0.1", o.direct_port), timeout=60) as s:
            s.sendall(wire.direct_hello(pb.DirectHello(
                learner_id="o", generation=o.generation, run_id=o.run_id, keepalive_s=1)))
            kind, body = wire.read_frame(s)
            assert kind == wire.FRAME_HEADER
            wire.read_exact(s, pb.BroadcastHeader.FromString(body).payload_bytes)
            assert [wire.read_frame(s) for _ in range(2)] == [(wire.FRAME_PING, b"")] * 2
        a.close()
    with socket.create_server(("127.0.0.1", 0)) as silent:
        reader = DirectReader.open("127.0.0.1", silent.getsockname()[1],
                                   pb.DirectHello(learner_id="x"), keepalive_s=0.2)
        with pytest.raises(StatusError) as e:
            list(reader)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "no word" in e.value.details()
