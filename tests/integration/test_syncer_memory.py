"""The syncer's chunked paths give the same bits as the whole-array computations they
replace, and a bad push leaves the state as it was. (Memory itself is measured by
scripts/bench_memory.py, never asserted here.)

Here: the checks through in-process servers, training or the sim (the others:
tests/unit/test_syncer_memory.py)."""


from __future__ import annotations

import grpc
import numpy as np
import pytest
from helpers.syncer import make_client, running_syncer

from yeto import codec, net
from yeto.layout import Layout
from yeto.proto import yeto_pb2 as pb
from yeto.proto import yeto_pb2_grpc as pb_grpc


def _stub_push(addr, chunks):
    with grpc.insecure_channel(addr, options=net.GRPC_OPTIONS) as ch:
        return pb_grpc.SyncerStub(ch).Push(iter(chunks), timeout=30)


@pytest.mark.parametrize("spill_min_bytes", [1 << 30, 0], ids=["in memory", "spilled"])
@pytest.mark.parametrize("case", ["nan chunk", "truncated", "overlong", "second header"])
def test_a_bad_chunk_mid_push_leaves_the_round_and_theta_unchanged(toy_layout, case,
                                                                  spill_min_bytes):
    n = toy_layout.numel
    with running_syncer(quorum=2, spill_min_bytes=spill_min_bytes) as (run, addr):
        a, b = make_client(addr, "a", toy_layout), make_client(addr, "b", toy_layout)
        a.start(np.zeros(n, np.float32))
        b.start(np.zeros(n, np.float32))
        a.wait_one(timeout=20), b.wait_one(timeout=20)
        ok = codec.encode(np.full(n, 0.5, np.float32), "q4")
        assert a.push(ok, encoding="q4", base_version=0, loss_tokens=5, steps=1,
                      seq=0).result(20).accepted
        digest, theta = run.state_digest(), run.theta.copy()
        acc_sum = run.rounds.open[0].acc.sum.copy()
        payload = codec.encode(np.ones(n, np.float32), "f32")
        if case == "nan chunk":
            payload = payload[:200] + np.array([np.nan], np.float32).tobytes() + payload[204:]
        header = pb.PushHeader(learner_id="b", generation=b.generation, round=1,
                               base_version=0, loss_tokens=7, steps=1, encoding="f32",
                               numel=n, payload_bytes=4 * n, kind=pb.DELTA, seq=0)
        pieces = [payload[i:i + 64] for i in range(0, len(payload), 64)]
        if case == "truncated":
            pieces = pieces[:-1]
        elif case == "overlong":
            pieces.append(b"\0\0\0\0")
        chunks = [pb.PushChunk(header=header if i == 0 else None, data=p)
                  for i, p in enumerate(pieces)]
        if case == "second header":
            chunks[3] = pb.PushChunk(header=header, data=pieces[3])
        with pytest.raises(grpc.RpcError) as e:
            _stub_push(addr, chunks)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert run.state_digest() == digest and run.version == 0
        assert run.theta.tobytes() == theta.tobytes()
        assert run.rounds.open[0].acc.sum.tobytes() == acc_sum.tobytes()
        # the same push, whole and in small chunks, is then taken and commits
        good = [pb.PushChunk(header=header if i == 0 else None, data=payload[j:j + 64])
                for i, j in enumerate(range(0, len(payload), 64))] if case != "nan chunk" \
            else [pb.PushChunk(header=header, data=codec.encode(np.ones(n, np.float32), "f32"))]
        assert _stub_push(addr, good).accepted
        assert a.wait_one(timeout=20).version == 1
        a.close(), b.close()


def test_a_broadcast_in_progress_keeps_its_version_across_a_commit():
    n = 3 * net.CHUNK_BYTES // 4 + 1000  # four chunks of f32
    layout = Layout.from_shapes({"w": (n,)})
    theta0 = np.random.default_rng(4).standard_normal(n).astype(np.float32)
    with running_syncer(quorum=1, grace_ms=0) as (run, addr):
        a = make_client(addr, "a", layout)
        a.start(theta0)
        a.wait_one(timeout=20)
        with grpc.insecure_channel(addr, options=net.GRPC_OPTIONS) as ch:
            stub = pb_grpc.SyncerStub(ch)
            join = stub.Join(pb.JoinRequest(learner_id="b", fingerprint=layout.fingerprint,
                                            layout=[pb.TensorSpec(name="w", shape=[n],
                                                                  dtype="float32")]))
            chunks = stub.Subscribe(pb.SubscribeRequest(learner_id="b",
                                                        generation=join.generation))
            first = next(chunks)
            assert first.header.version == 0
            got = [first.data]
            d = np.full(n, 0.25, np.float32)
            assert a.push(codec.encode(d, "f32"), encoding="f32", base_version=0,
                          loss_tokens=1, steps=1, seq=0).result(20).accepted
            assert a.wait_one(timeout=20).version == 1 and run.version == 1
            while sum(map(len, got)) < 4 * n:
                got.append(next(chunks).data)
            assert b"".join(got) == theta0.tobytes()  # version 0, whole
            nxt = next(chunks)
            assert nxt.header.version == 1
            chunks.cancel()
        a.close()


def test_a_push_that_cannot_be_spilled_is_lost_retryably_and_changes_nothing(toy_layout,
                                                                             tmp_path):
    """The spill folder gone (a full or unmounted disk): the push is answered
    RESOURCE_EXHAUSTED with what to do, which the client reports as `Lost` (retry
    later, not a refusal); the state is untouched, and the same push is taken once the
    folder is back."""
    from yeto.transport import Lost

    n, state = toy_layout.numel, tmp_path / "state"
    with running_syncer(quorum=1, state_dir=state, spill_min_bytes=0) as (run, addr):
        a = make_client(addr, "a", toy_layout)
        a.start(np.zeros(n, np.float32))
        assert a.wait_one(timeout=20).version == 0
        payload = codec.encode(np.full(n, 0.25, np.float32), "q4")
        # 0 loss tokens: not summed as it arrives (syncer.staging), so it is spilled
        push = dict(encoding="q4", base_version=0, loss_tokens=0, steps=1, seq=0)
        digest = run.state_digest()
        state.rename(tmp_path / "away")
        with pytest.raises(Lost, match="RESOURCE_EXHAUSTED.*spill file"):
            a.push(payload, **push).result(20)
        assert run.state_digest() == digest and run.version == 0 and run.rejected == 1
        (tmp_path / "away").rename(state)
        assert a.push(payload, **push).result(20).accepted
        assert a.wait_one(timeout=20).version == 1
        a.close()
