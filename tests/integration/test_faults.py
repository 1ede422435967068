"""Faults and bad input: auth, TLS, state and --resume, rejoin, validation, clipping.

Process tests run the real syncer (`python -m syncer`) and synthetic numpy islands
(`yeto.testing.synthetic`) as subprocesses and kill them with SIGKILL.

Here: the checks through in-process servers, training or the sim (the others:
tests/e2e/test_faults.py)."""


import os
import socket
import threading
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
from helpers.syncer import make_client, running_syncer
from helpers.wait import wait_until

from syncer import state
from syncer.bounds import Bounds
from syncer.run import Config, Run
from syncer.service import serve
from syncer.tape import read_tape
from yeto import codec, net
from yeto.island import Island
from yeto.proto import yeto_pb2 as pb
from yeto.proto import yeto_pb2_grpc as pb_grpc
from yeto.testing.synthetic import Quadratic
from yeto.transport import Refused


# ---- state on disk ------------------------------------------------------------------
def _committed_run(state_dir: Path, layout, **cfg) -> Run:
    with running_syncer(state_dir=state_dir, quorum=1, **cfg) as (run, addr):
        c = make_client(addr, "a", layout)
        c.start(np.linspace(-1, 1, layout.numel).astype(np.float32))
        c.wait_one(timeout=20)
        for v in range(3):
            d = np.sin(np.arange(layout.numel) + v).astype(np.float32)
            c.push(codec.encode(d, "f32"), encoding="f32", base_version=v, loss_tokens=7,
                   steps=1, seq=v).result(20)
            c.wait_one(timeout=20)
        c.close()
        return run


def test_resume_restores_momentum_bit_exact_and_refuses_mismatches(tmp_path, toy_layout):
    sd = tmp_path / "s"
    first = _committed_run(sd, toy_layout)
    resumed = Run(Config(state_dir=sd, resume=True, quorum=1))
    assert resumed.version == 3 and resumed.run_id == first.run_id
    assert resumed.theta.tobytes() == first.theta.tobytes()
    assert resumed.momentum.tobytes() == first.momentum.tobytes()
    assert resumed.members.rows["a"].last_seq == 2
    resumed.tape.close()
    with pytest.raises(state.StateError, match="--outer-lr was 0.4, now 0.5"):
        Run(Config(state_dir=sd, resume=True, outer_lr=0.5))
    with pytest.raises(state.StateError, match="--resume"):
        Run(Config(state_dir=sd))
    # a corrupt or truncated file is refused, and left as it was
    path = sd / state.STATE_FILE
    good = path.read_bytes()
    for bad in (good[: len(good) // 2], good[:-8] + b"\xff" * 8, b"garbage"):
        path.write_bytes(bad)
        with pytest.raises(state.StateError, match="corrupt|digests"):
            Run(Config(state_dir=sd, resume=True))
        assert path.read_bytes() == bad
    path.write_bytes(good)


def test_resumed_syncer_refuses_other_layout(tmp_path, toy_layout):
    from yeto.layout import Layout

    sd = tmp_path / "s"
    _committed_run(sd, toy_layout)
    other = Layout.from_shapes({"x.layers.0.a": (3, 3)})
    with running_syncer(state_dir=sd, resume=True, quorum=1) as (run, addr):
        c = make_client(addr, "b", other)
        c.start(np.zeros(other.numel, np.float32))
        assert wait_until(lambda: c.fatal is not None)
        assert "differ" in c.fatal
        c.close()


# ---- rejoin ----------------------------------------------------------------------------
def test_late_joiner_starts_from_current_theta_and_rejoin_never_double_counts(toy_layout):
    init = np.zeros(toy_layout.numel, np.float32)
    one = np.ones(toy_layout.numel, np.float32)
    with running_syncer(quorum=1, outer_lr=1.0, outer_momentum=0.0) as (run, addr):
        a = make_client(addr, "a", toy_layout)
        a.start(init)
        a.wait_one(timeout=20)
        a.push(codec.encode(one, "f32"), encoding="f32", base_version=0, loss_tokens=1,
               steps=1, seq=0).result(20)
        assert a.wait_one(timeout=20).version == 1
        late = make_client(addr, "late", toy_layout)
        late.start(init)
        got = late.wait_one(timeout=20)
        assert got.version == 1 and np.array_equal(got.theta, init - one)
        # "a" reconnects (new generation): its old push seq is known, a replay is a duplicate
        a2 = make_client(addr, "a", toy_layout)
        a2.start(init)
        assert a2.wait_one(timeout=20).version == 1 and a2.acked_seq == 0
        assert a2.generation > a.generation
        with pytest.raises(Refused, match="FAILED_PRECONDITION"):  # superseded connection
            a.push(codec.encode(one, "f32"), encoding="f32", base_version=1, loss_tokens=1,
                   steps=1, seq=1).result(20)
        r = a2.push(codec.encode(one, "f32"), encoding="f32", base_version=1, loss_tokens=1,
                    steps=1, seq=0).result(20)
        assert r.status == "duplicate" and run.version == 1
        for c in (a, late, a2):
            c.close()


# ---- validation before state ------------------------------------------------------------
def _raw_push(stub, chunks, token=None):
    return stub.Push(iter(chunks), metadata=net.auth_metadata(token), timeout=20)


def test_bad_input_is_refused_with_state_unchanged(toy_layout, tmp_path):
    init = np.zeros(toy_layout.numel, np.float32)
    n = toy_layout.numel
    with running_syncer(quorum=1, state_dir=tmp_path / "s", token="tok") as (run, addr):
        a = make_client(addr, "a", toy_layout, token="tok")
        a.start(init)
        a.wait_one(timeout=20)
        gen = a.generation
        digest = run.state_digest()
        channel = grpc.insecure_channel(addr, options=net.GRPC_OPTIONS)
        stub = pb_grpc.SyncerStub(channel)

        def header(**kw):
            base = dict(learner_id="a", generation=gen, round=1, base_version=0,
                        loss_tokens=5, steps=1, encoding="f32", numel=n, payload_bytes=4 * n,
                        seq=0)
            return pb.PushHeader(**{**base, **kw})

        good = codec.encode(np.ones(n, np.float32), "f32")
        nan = np.ones(n, np.float32)
        nan[3] = np.nan
        inf = bytearray(good)
        inf[8:12] = np.array([np.inf], np.float32).tobytes()
        cases = {
            "truncated stream": [pb.PushChunk(header=header(), data=good[:100])],
            "wrong shape": [pb.PushChunk(header=header(numel=n + 1, payload_bytes=4 * n + 4),
                                         data=good + b"\0\0\0\0")],
            "NaN payload": [pb.PushChunk(header=header(), data=nan.tobytes())],
            "Inf payload": [pb.PushChunk(header=header(), data=bytes(inf))],
            "overlong payload": [pb.PushChunk(header=header(), data=good + b"x")],
            "wrong round": [pb.PushChunk(header=header(round=5), data=good)],
            "future version": [pb.PushChunk(header=header(base_version=9, round=10),
                                            data=good)],
            "unknown learner": [pb.PushChunk(header=header(learner_id="mallory"), data=good)],
            "stale generation": [pb.PushChunk(header=header(generation=gen + 7), data=good)],
            "bad encoding": [pb.PushChunk(header=header(encoding="q8"), data=good)],
            "no header": [pb.PushChunk(data=good)],
            "two headers": [pb.PushChunk(header=header(), data=good[:8]),
                            pb.PushChunk(header=header(), data=good[8:])],
        }
        for name, chunks in cases.items():
            with pytest.raises(grpc.RpcError) as e:
                _raw_push(stub, chunks, token="tok")
            assert e.value.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                      grpc.StatusCode.FAILED_PRECONDITION,
                                      grpc.StatusCode.NOT_FOUND), name
            assert e.value.details(), name
            assert run.state_digest() == digest, name
        # oversize message: one chunk past the message limit
        with pytest.raises(grpc.RpcError) as e:
            _raw_push(stub, [pb.PushChunk(header=header(), data=b"\0" * (net.MAX_MESSAGE_BYTES
                                                                         + 10))], token="tok")
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # missing and wrong tokens: UNAUTHENTICATED, nothing else happens
        for token in (None, "wrong"):
            with pytest.raises(grpc.RpcError) as e:
                _raw_push(stub, cases["NaN payload"], token=token)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as e:
                stub.Join(pb.JoinRequest(learner_id="x"), metadata=net.auth_metadata(token))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # a wrong layout fingerprint at join
        bad_join = pb.JoinRequest(learner_id="b", fingerprint="0" * 64, layout=[
            pb.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype)
            for s in toy_layout.specs])
        with pytest.raises(grpc.RpcError) as e:
            stub.Join(bad_join, metadata=net.auth_metadata("tok"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # garbage bytes straight onto the port
        host, port = net.parse_address(addr)
        with socket.create_connection((host, port)) as s:
            s.sendall(os.urandom(4096))
            s.settimeout(2)
            try:
                s.recv(100)
            except OSError:
                pass
        assert run.state_digest() == digest
        # a replayed push: accepted once, then a duplicate, merged once
        assert _raw_push(stub, [pb.PushChunk(header=header(), data=good)], "tok").accepted
        assert a.wait_one(timeout=20).version == 1
        replay = _raw_push(stub, [pb.PushChunk(header=header(), data=good)], "tok")
        assert replay.status == "duplicate" and run.version == 1
        channel.close()
        # still serving a valid island after all of it
        r = a.push(codec.encode(np.ones(n, np.float32), "f32"), encoding="f32", base_version=1,
                   loss_tokens=3, steps=1, seq=1).result(20)
        assert r.accepted and a.wait_one(timeout=20).version == 2
        a.close()
    tape = read_tape(tmp_path / "s" / "tape.jsonl")
    rejected = [r for r in tape if r["event"] == "rejected"]
    assert len(rejected) >= len(cases)  # every refusal is counted in the tape


class _NanFirstSyncer(pb_grpc.SyncerServicer):
    """The syncer's protocol over a real gRPC server, with a fault: the first broadcast
    holds a NaN in its second chunk; every later subscription gets good weights (as
    a syncer would resend on a rejoin)."""

    def __init__(self, good: np.ndarray):
        self.good, self.subscribed, self.stop = good, 0, threading.Event()

    def Join(self, request, context):  # noqa: N802 - the generated servicer's names
        return pb.JoinReply(run_id="nan", generation=1, num_fragments=1, quorum=1, joined=1,
                            version=1, downlink="f32")

    def Subscribe(self, request, context):  # noqa: N802
        self.subscribed += 1
        theta = self.good.copy()
        if self.subscribed == 1:
            theta[-1] = np.nan
        payload, half = theta.tobytes(), theta.size // 2 * 4
        yield pb.BroadcastChunk(header=pb.BroadcastHeader(
            version=1, encoding="f32", numel=theta.size, payload_bytes=len(payload)),
            data=payload[:half])
        yield pb.BroadcastChunk(data=payload[half:])
        self.stop.wait(60)  # the stream stays open, as a syncer's does


def test_client_drops_a_non_finite_broadcast_and_reconnects(toy_layout, rng):
    good = rng.standard_normal(toy_layout.numel).astype(np.float32)
    fake = _NanFirstSyncer(good)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_SyncerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = make_client(f"127.0.0.1:{port}", "a", toy_layout)
    try:
        client.start(np.zeros(toy_layout.numel, np.float32))
        got = client.wait_one(timeout=60)
        assert got is not None, client.last_error  # the client lived on past the NaN
        np.testing.assert_array_equal(got.theta, good)
        assert fake.subscribed == 2 and "non-finite" in client.last_error
    finally:
        client.close()
        fake.stop.set()
        server.stop(grace=0).wait()


# ---- robust merge -------------------------------------------------------------------------
def _one_round_moves(layout, init, deltas, **syncer_kw) -> float:
    """‖Θ − init‖ after one round through the real server in which island i (the last
    one "evil") pushes deltas[i] (f32, 10 loss tokens each)."""
    ids = [*"abcdefgh"[:len(deltas) - 1], "evil"]
    with running_syncer(quorum=len(deltas), **syncer_kw) as (run, addr):
        cs = [make_client(addr, i, layout) for i in ids]
        for c in cs:
            c.start(init)
        for c in cs:
            c.wait_one(timeout=20)
        for c, d in zip(cs, deltas):
            c.push(codec.encode(d, "f32"), encoding="f32", base_version=0, loss_tokens=10,
                   steps=1, seq=0).result(20)
        moved = float(np.linalg.norm(cs[0].wait_one(timeout=20).theta - init))
        for c in cs:
            c.close()
    return moved


def test_clip_factor_bounds_a_poisoned_island(toy_layout, rng):
    init = np.zeros(toy_layout.numel, np.float32)
    honest = [rng.standard_normal(toy_layout.numel).astype(np.float32) * 0.01 for _ in range(2)]
    poison = honest[0] * 1000
    lr, mu, clip = 0.7, 0.9, 2.0
    moved = {}
    for factor in (0.0, clip):
        # the norm and centre bounds off (syncer.bounds): clipping alone bounds the poison
        moved[factor] = _one_round_moves(toy_layout, init, [*honest, poison], outer_lr=lr,
                                         outer_momentum=mu, clip_factor=factor,
                                         bounds=Bounds(norm_factor=0, center_factor=0))
    median = float(np.median([np.linalg.norm(x) for x in [*honest, poison]]))
    bound = lr * (1 + mu) * clip * median  # first round: Θ moves lr·(1+μ)·g, ‖g‖ ≤ clip·median
    assert moved[clip] <= bound * (1 + 1e-5)
    assert moved[0.0] > 100 * bound  # without clipping the poison dominates


def test_the_centre_bound_pulls_a_poisoned_island_in(toy_layout, rng):
    """Through the real server, three honest islands and one whose push sits 1000× their
    disagreement away from them (the norm bound off, so only the centre bound acts): its
    part of the merge is pulled in to 3× the honest islands' typical distance from the
    median, and Θ moves about as far as the honest pushes alone would move it."""
    init = np.zeros(toy_layout.numel, np.float32)
    consensus = rng.standard_normal(toy_layout.numel).astype(np.float32) * 0.01
    honest = [consensus + rng.standard_normal(toy_layout.numel).astype(np.float32) * 0.002
              for _ in range(3)]
    poison = consensus + rng.standard_normal(toy_layout.numel).astype(np.float32) * 2.0
    moved = {}
    for factor in (0.0, 3.0):
        moved[factor] = _one_round_moves(toy_layout, init, [*honest, poison], outer_lr=1.0,
                                         outer_momentum=0.0,
                                         bounds=Bounds(norm_factor=0, center_factor=factor))
    alone = float(np.linalg.norm(np.mean(honest, axis=0)))  # the honest merge's step
    assert moved[3.0] <= 1.5 * alone, (moved, alone)
    assert moved[0.0] > 20 * alone, (moved, alone)  # without it the poison dominates


def test_an_island_that_trained_through_a_syncer_restart_pushes_again(tmp_path, toy_layout):
    """A syncer stopped and resumed while an island trained on: the steps the island
    took offline all went into its next push, which claimed more than the syncer allows
    an island that missed no commit (H × 2), and was refused; so was every later one
    (each carried the last): the island never pushed again (the recover-from-a-crash
    page hung on it). Now the island cuts the claim it carries to 2H after such a
    refusal (the work still goes out whole): one push is refused, the next is merged,
    and the run goes on."""
    H, state_dir = 2, tmp_path / "state"
    run = Run(Config(quorum=1, state_dir=state_dir, grace_ms=0))
    server, port = serve(run, "127.0.0.1", 0)
    client = make_client(f"127.0.0.1:{port}", "a", toy_layout, sync_every=H)  # declared
    model = Quadratic(toy_layout, 0, 0.05)
    island = Island(model, client=client, sync_every=H)
    steps = []

    def train_until(pred, what):
        def step():
            island.before_update()
            model.update()
            island.after_step(10)
            steps.append(island.version)
            return pred()
        assert wait_until(step, timeout=60, interval=0.01), what

    try:
        island.start()
        train_until(lambda: island.version >= 2, "two rounds before the stop")
        server.ticker_stop.set()
        server.stop(grace=0).wait()
        run.tape.close()
        before = island.version
        train_until(lambda: len(steps) > 20 * H, "steps while the syncer is down")
        resumed = Run(Config(quorum=1, state_dir=state_dir, grace_ms=0, resume=True))
        server, _ = serve(resumed, "127.0.0.1", port)
        run = resumed
        train_until(lambda: island.version > before, "a round after the restart")
        refused = [r for r in read_tape(state_dir / "tape.jsonl") if r["event"] == "rejected"]
        assert len(refused) <= 1 and all("schedule allows" in r["detail"] for r in refused)
    finally:
        client.close()
        server.ticker_stop.set()
        server.stop(grace=0).wait()
        run.tape.close()
