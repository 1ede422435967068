"""Streams a peer holding a valid credential keeps open to cost the syncer (issue 44,
trust round two): a push kept alive by empty chunks, broadcast readers that stall to
make the syncer keep copies of Θ. Through real in-process gRPC syncers.

The first round of these bounds: tests/integration/test_trust.py (whose helpers this
uses)."""


import gc
import threading

import grpc
import numpy as np
import pytest
from helpers.syncer import make_client, push_delta, running_syncer, wait_version

from integration.test_trust import _join, _started, _stub
from syncer.admission import Streams
from syncer.broadcast import Downlink, Source
from syncer.run import Config, Run
from syncer.service import serve
from yeto import codec, net
from yeto.layout import Layout
from yeto.proto import yeto_pb2 as pb
from yeto.proto import yeto_pb2_grpc as pb_grpc


@pytest.mark.parametrize("trickle", [b"", b"\0"], ids=["empty chunks", "a byte at a time"])
def test_a_push_that_barely_moves_is_cut_off(toy_layout, trickle):
    """Every chunk reset a push's idle watch, empty or not: a push that sent its header
    and then only empty chunks (or a byte at a time) never expired, holding a push slot
    and a worker for good (or for as long as it pleased). Now the watch counts payload:
    a push must move 64 KiB, or arrive whole, within --stream-idle-s, else it is cut off
    as a silent push is, and the slot is free again."""
    n = toy_layout.numel
    assert 4 * n > 100  # a byte per 10 ms takes longer than --stream-idle-s (1 s) to arrive
    run = Run(Config(quorum=1))
    server, port = serve(run, "127.0.0.1", 0, max_inflight_pushes=1,
                         streams=Streams(idle_s=1.0))
    addr, release = f"127.0.0.1:{port}", threading.Event()
    try:
        a, = _started(addr, toy_layout, ["a"], token=None)
        header = pb.PushHeader(learner_id="a", generation=a.generation, round=1,
                               base_version=0, loss_tokens=1, steps=1, encoding="f32",
                               numel=n, payload_bytes=4 * n, seq=0)

        def chunks():
            yield pb.PushChunk(header=header)
            while not release.wait(0.01):  # until the call ends
                yield pb.PushChunk(data=trickle)

        with pytest.raises(grpc.RpcError) as e:  # (its own deadline: a hang guard only)
            _stub(addr).Push(chunks(), timeout=90)
        assert e.value.code() == grpc.StatusCode.CANCELLED, e.value.details()
        release.set()
        r = a.push(codec.encode(np.ones(n, np.float32), "f32"), encoding="f32",
                   base_version=0, loss_tokens=3, steps=1, seq=0).result(60)
        assert r.accepted and a.wait_one(timeout=30).version == 1
        a.close()
    finally:
        release.set()
        server.ticker_stop.set()
        server.stop(grace=0).wait()


def _kept_copies() -> list[int]:
    """The bytes of each copy of Θ broadcast sources hold now (a live source views Θ
    and holds none)."""
    gc.collect()
    return [o._array.nbytes for o in gc.get_objects() if type(o) is Source  # (isinstance
            # would look through a dead weakref.proxy another test left, and raise)
            and o._array is not None and o._array.base is None]


def _rest_of(stream, first) -> bytes:
    """The payload of the broadcast whose first chunk was `first`."""
    data = [bytes(first.data)]
    size = first.header.payload_bytes
    while sum(map(len, data)) < size:
        data.append(bytes(next(stream).data))
    return b"".join(data)


def test_stalled_broadcast_readers_cannot_multiply_copies_of_theta(rng):
    """A broadcast reader that stalls mid-stream makes the commit after it copy what it
    has not read of Θ (so it finishes with the version it started). One stalled reader
    per version cost a copy of Θ each, without bound. Now at most `Downlink.KEPT` older
    versions are kept; the reader of an older one is ended (RESOURCE_EXHAUSTED: its
    island reconnects for the newest), and the readers kept get their version's exact
    bytes."""
    layout = Layout.from_shapes({"w.lora_A.weight": (1 << 17, 64)})  # 32 MiB of f32:
    n, stalled = layout.numel, Downlink.KEPT + 1  # far more than gRPC buffers per stream
    with running_syncer(quorum=1) as (run, addr):
        a = make_client(addr, "a", layout)
        a.start(rng.standard_normal(n).astype(np.float32))
        thetas = [wait_version(a, 0).theta.tobytes()]
        # the stalled reader's receive window stays gRPC's initial one (no BDP probing
        # to grow it toward all of Θ): what a stream buffers cannot depend on timing
        stub = pb_grpc.SyncerStub(grpc.insecure_channel(
            addr, options=[*net.GRPC_OPTIONS, ("grpc.http2.bdp_probe", 0)]))
        gen = _join(stub, layout, "reader", None, observer=True).generation
        streams = []
        for v in range(stalled):  # a reader of version v stalls after its first chunk
            s = stub.Subscribe(pb.SubscribeRequest(learner_id="reader", generation=gen),
                               timeout=120)
            first = next(s)
            assert first.header.version == v
            streams.append((s, first))
            push_delta(a, rng.standard_normal(n).astype(np.float32) * 1e-3, 3, v, v)
            thetas.append(wait_version(a, v + 1).theta.tobytes())
        copies = _kept_copies()
        assert len(copies) <= Downlink.KEPT and sum(copies) <= Downlink.KEPT * 4 * n, copies
        oldest, first = streams[0]
        with pytest.raises(grpc.RpcError) as e:
            _rest_of(oldest, first)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "fell behind" in e.value.details() and "reconnect" in e.value.details()
        for v in range(1, stalled):  # the kept ones: each its own version, bit for bit
            assert _rest_of(*streams[v]) == thetas[v]
        for s, _ in streams:
            s.cancel()
        a.close()
