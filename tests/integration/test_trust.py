"""The trust boundary (issue 28): what an island holding a valid credential, a silent
peer, a full disk or an operator's slip can do to a run. One test per failure class,
each through a real gRPC syncer (in this process, or `python -m syncer` where the
process is what fails); each of them failed before the bounds existed.

Here: the checks through in-process servers, training or the sim (the others:
tests/unit/test_trust.py, tests/e2e/test_trust.py)."""


import struct
import threading

import grpc
import numpy as np
import pytest
from helpers.syncer import AVERAGING, make_client, running_syncer
from helpers.wait import wait_until

from syncer import state
from syncer.admission import Streams
from syncer.bounds import HISTORY, Bounds
from syncer.run import Config, Run
from syncer.service import serve
from syncer.tape import read_tape
from yeto import codec, net
from yeto.layout import Layout, TensorSpec
from yeto.proto import yeto_pb2 as pb
from yeto.proto import yeto_pb2_grpc as pb_grpc

SECRET = "run-secret"


def _stub(addr):
    return pb_grpc.SyncerStub(grpc.insecure_channel(addr, options=net.GRPC_OPTIONS))


def _join(stub, layout, learner, credential, **kw):
    req = pb.JoinRequest(learner_id=learner, fingerprint=layout.fingerprint, layout=[
        pb.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype) for s in layout.specs],
        **kw)
    return stub.Join(req, metadata=net.auth_metadata(credential), timeout=20)


def _push(stub, credential, payload, **header):
    h = dict(dict(round=1, base_version=0, loss_tokens=10, steps=1, encoding="f32", seq=0,
                  payload_bytes=len(payload)), **header)
    return stub.Push(iter([pb.PushChunk(header=pb.PushHeader(**h), data=payload)]),
                     metadata=net.auth_metadata(credential), timeout=20)


def _started(addr, layout, learners, token=SECRET, then=lambda: None):
    """Clients that joined and hold version 0 (round 1 open); `then()` runs once they
    have joined (raw joins that complete the quorum)."""
    cs = [make_client(addr, i, layout, token=token) for i in learners]
    for c in cs:
        c.start(np.zeros(layout.numel, np.float32))
    for c in cs:
        assert c.connected.wait(30), c.last_error
    then()
    for c in cs:
        assert c.wait_one(timeout=30) is not None, c.last_error
    return cs


def _cred(learner):
    return net.island_credential(SECRET, learner)


# ---- numbers ----------------------------------------------------------------------------
def test_huge_finite_pushes_are_refused_and_theta_stays_finite(toy_layout):
    """A push of 1e38 (f32) or a q4 block scale of 3e38 used to be summed: Θ became
    -inf, was saved and broadcast, and no round committed again."""
    n = toy_layout.numel
    with running_syncer(quorum=2, token=SECRET) as (run, addr):
        stub, joined = _stub(addr), []
        honest, = _started(addr, toy_layout, ["honest"], then=lambda: joined.append(
            _join(stub, toy_layout, "rogue", _cred("rogue"))))
        gen = joined[0].generation
        digest = run.state_digest()
        q4 = bytearray(codec.encode(np.ones(n, np.float32), "q4"))
        q4[0:4] = struct.pack("<f", 3e38)
        for enc, payload in (("f32", np.full(n, 1e38, np.float32).tobytes()), ("q4", q4)):
            with pytest.raises(grpc.RpcError) as e:
                _push(stub, _cred("rogue"), bytes(payload), learner_id="rogue", generation=gen,
                      encoding=enc, numel=n)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "bound" in e.value.details()
        assert run.state_digest() == digest
        # the round commits with an honest push, and every island gets a finite Θ
        ok = _push(stub, _cred("rogue"), np.full(n, 0.5, np.float32).tobytes(),
                   learner_id="rogue", generation=gen, numel=n)
        assert ok.accepted
        honest.push(codec.encode(np.full(n, 0.1, np.float32), "f32"), encoding="f32",
                    base_version=0, loss_tokens=10, steps=1, seq=0).result(20)
        got = honest.wait_one(timeout=30)
        assert got.version == 1 and np.isfinite(got.theta).all()
        assert np.allclose(got.theta, -0.3)
        honest.close()


def _merges(state_dir):
    return [r for r in read_tape(state_dir / "tape.jsonl") if r["event"] == "merge"]


def test_the_first_push_is_bounded_by_the_seed(toy_layout, rng, tmp_path):
    """Before a fragment's 4th push there was no norm bound: one push moved Θ 6.4e4.
    Now a push before any other island's is bounded by 10 x the seed's norm."""
    n = toy_layout.numel
    seed = rng.standard_normal(n).astype(np.float32) * 0.1
    with running_syncer(quorum=1, state_dir=tmp_path / "s", **AVERAGING) as (run, addr):
        c = make_client(addr, "a", toy_layout)
        c.start(seed.copy())
        assert c.wait_one(timeout=30) is not None, c.last_error
        c.push(codec.encode(np.full(n, 1e2, np.float32), "f32"), encoding="f32",
               base_version=0, loss_tokens=5, steps=1, seq=0).result(20)
        moved = c.wait_one(timeout=30).theta - seed
        c.close()
    assert np.linalg.norm(moved) == pytest.approx(10 * np.linalg.norm(seed), rel=1e-4)
    assert _merges(tmp_path / "s")[0]["responders"][0]["bound_scale"] < 0.02


def test_a_rogue_cannot_raise_its_own_norm_bound(toy_layout, rng, tmp_path):
    """The bound came from every island's norms as scaled, with np.median averaging two
    middle values: one rogue beside one honest island grew it 0.64 -> 91 -> 11,281 ->
    319,680 over 200 rounds. Now each island's bound comes from the others' norms."""
    n = toy_layout.numel
    rounds = 12
    seed = rng.standard_normal(n).astype(np.float32) * 0.01  # round 1: 10 x its norm
    with running_syncer(quorum=2, state_dir=tmp_path / "s", **AVERAGING) as (run, addr):
        honest, rogue = (make_client(addr, i, toy_layout) for i in ("honest", "rogue"))
        for c in (honest, rogue):
            c.start(seed.copy())
        for c in (honest, rogue):
            assert c.wait_one(timeout=30) is not None, c.last_error
        for v in range(rounds):
            d = rng.standard_normal(n).astype(np.float32) * 0.01
            pushes = [honest.push(codec.encode(d, "f32"), encoding="f32", base_version=v,
                                  loss_tokens=5, steps=1, seq=v),
                      rogue.push(codec.encode(np.full(n, 10.0 ** min(v, 2), np.float32), "f32"),
                                 encoding="f32", base_version=v, loss_tokens=5, steps=1,
                                 seq=v)]
            for p in pushes:
                p.result(20)
            for c in (honest, rogue):
                assert c.wait_one(timeout=30).version == v + 1
        for c in (honest, rogue):
            c.close()
    honest_norms, rogue_merged = [], []
    for rec in _merges(tmp_path / "s"):
        by = {r["learner"]: r for r in rec["responders"]}
        honest_norms.append(by["honest"]["norm"])
        rogue_merged.append(by["rogue"]["norm"] * by["rogue"]["bound_scale"])
    assert len(rogue_merged) == rounds
    for k in range(1, rounds):  # from round 2 on: 10 x the honest island's median norm
        # (the honest push of round k may have come before the rogue's, or after it)
        bound = 10 * max(float(np.median(honest_norms[max(0, j - HISTORY):j]))
                         for j in (k, k + 1))
        assert rogue_merged[k] <= bound * (1 + 1e-5), (k, honest_norms, rogue_merged)
    assert max(rogue_merged) < 20 * max(honest_norms)


def _rogue_beside_honest(addr, stub, layout, **declared):
    """An honest client started, and a raw "rogue" joined (100 tokens per step and
    `declared`) as the quorum's second: (the honest client, the rogue's generation)."""
    joined = []
    honest, = _started(addr, layout, ["honest"], then=lambda: joined.append(
        _join(stub, layout, "rogue", _cred("rogue"), tokens_per_step=100, **declared)))
    return honest, joined[0].generation


def test_steps_are_bounded_by_the_declared_schedule(toy_layout):
    """A rogue claiming 100,000 steps took a merge share of 0.9998 against an honest
    island's 20. Now steps <= the H declared at the first join x (2 + rounds missed)."""
    n = toy_layout.numel
    with running_syncer(quorum=2, token=SECRET) as (run, addr):
        stub = _stub(addr)
        honest, gen = _rogue_beside_honest(addr, stub, toy_layout, sync_every=10)
        payload = np.full(n, 0.5, np.float32).tobytes()
        digest = run.state_digest()
        with pytest.raises(grpc.RpcError) as e:
            _push(stub, _cred("rogue"), payload, learner_id="rogue", generation=gen,
                  numel=n, loss_tokens=100, steps=21)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "every 10 steps" in e.value.details()
        assert run.state_digest() == digest
        with pytest.raises(grpc.RpcError) as e:  # a rejoin may not raise the schedule
            _join(stub, toy_layout, "rogue", _cred("rogue"), tokens_per_step=100,
                  sync_every=1000)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "steps between pushes" in e.value.details()
        assert _push(stub, _cred("rogue"), payload, learner_id="rogue", generation=gen,
                     numel=n, loss_tokens=2000, steps=20).accepted
        honest.close()


def test_steps_are_bounded_by_the_wall_time_at_the_fleets_speed(toy_layout):
    """An island that declares no schedule (a time-based one) could claim 100,000 steps
    in any push. With --max-steps-per-second R, a push claims at most R x (the seconds
    since its island's last accepted push, or its join, + 1): the run's clock decides,
    not the island."""
    n, now = toy_layout.numel, [1000.0]
    with running_syncer(quorum=2, token=SECRET, clock=lambda: now[0],
                        bounds=Bounds(max_steps_per_second=10)) as (run, addr):
        stub = _stub(addr)
        honest, gen = _rogue_beside_honest(addr, stub, toy_layout)
        now[0] += 5.0  # five seconds after both joined: at most 10 x (5 + 1) = 60 steps
        payload = np.full(n, 0.5, np.float32).tobytes()
        digest = run.state_digest()
        with pytest.raises(grpc.RpcError) as e:
            _push(stub, _cred("rogue"), payload, learner_id="rogue", generation=gen,
                  numel=n, loss_tokens=6100, steps=61)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "at 10 steps per second (--max-steps-per-second)" in e.value.details()
        assert "allow at most 60" in e.value.details()
        assert run.state_digest() == digest
        reply = _push(stub, _cred("rogue"), payload, learner_id="rogue", generation=gen,
                      numel=n, loss_tokens=6000, steps=60)
        assert reply.accepted
        assert [r["steps"] for r in run.rounds.get(0).responders] == [60]
        honest.close()


def test_no_island_holds_more_than_its_share_of_a_merge(toy_layout, tmp_path):
    """With three islands the default cap is 2/3: a rogue claiming 1,000x the honest
    tokens is merged at weight 2 x the others' sum, its direction kept."""
    n = toy_layout.numel
    with running_syncer(quorum=3, state_dir=tmp_path / "s", **AVERAGING) as (run, addr):
        cs = _started(addr, toy_layout, ["a", "b", "rogue"], token=None)
        values = {"a": 0.1, "b": 0.2, "rogue": -0.9}
        tokens = {"a": 10, "b": 10, "rogue": 10_000}
        for c in cs:
            c.push(codec.encode(np.full(n, values[c.learner_id], np.float32), "f32"),
                   encoding="f32", base_version=0, loss_tokens=tokens[c.learner_id], steps=1,
                   seq=0).result(20)
        theta = cs[0].wait_one(timeout=30).theta
        for c in cs:
            c.close()
    # weights 10, 10 and t = (2/3 x 20) / (1 - 2/3) = 40: the rogue's share is 2/3
    want = -(10 * 0.1 + 10 * 0.2 + 40 * -0.9) / 60
    assert np.allclose(theta, want, rtol=1e-6)
    rec = _merges(tmp_path / "s")[0]
    shares = {r["learner"]: r["share"] for r in rec["responders"]}
    assert shares["rogue"] == pytest.approx(2 / 3) and set(rec["share_scales"]) == {"rogue"}


def test_only_the_first_island_to_join_is_asked_for_the_seed(toy_layout):
    """Every joiner was asked for the seed while Θ was unset and the first to arrive won:
    a late joiner seeded Θ with 9.9e7 values."""
    n = toy_layout.numel
    with running_syncer(quorum=2, token=SECRET) as (run, addr):
        stub = _stub(addr)
        first = _join(stub, toy_layout, "first", _cred("first"))
        late = _join(stub, toy_layout, "late", _cred("late"))
        assert first.send_seed and not late.send_seed
        with pytest.raises(grpc.RpcError) as e:
            _push(stub, _cred("late"), np.full(n, 9.9e7, np.float32).tobytes(),
                  learner_id="late", generation=late.generation, numel=n,
                  kind=pb.PushKind.SEED)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "first" in e.value.details() and run.theta is None
        assert _push(stub, _cred("first"), np.zeros(n, np.float32).tobytes(),
                     learner_id="first", generation=first.generation, numel=n,
                     kind=pb.PushKind.SEED).accepted
        assert np.all(run.theta == 0)
    with running_syncer(quorum=2, token=SECRET, seed_from="named") as (run, addr):
        stub = _stub(addr)
        assert not _join(stub, toy_layout, "first", _cred("first")).send_seed
        assert _join(stub, toy_layout, "named", _cred("named")).send_seed


def test_an_observer_never_fixes_the_run_s_layout(toy_layout):
    """An observer joining first used to set the run's layout: every real island was
    refused. Now the first training island's layout is the run's, and an observer that
    joined with another one is turned away."""
    other = Layout([TensorSpec("w", (3, 3), "float32")], 1)
    with running_syncer(quorum=1, token=SECRET) as (run, addr):
        stub = _stub(addr)
        obs = _join(stub, other, "node", _cred("node"), observer=True)
        assert not obs.send_seed
        island = _join(stub, toy_layout, "island", _cred("island"))
        assert island.send_seed and run.layout.fingerprint == toy_layout.fingerprint
        with pytest.raises(grpc.RpcError) as e:  # the observer's connection is stale now
            stub.Heartbeat(pb.HeartbeatRequest(learner_id="node", generation=obs.generation),
                           metadata=net.auth_metadata(_cred("node")), timeout=20)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as e:
            _join(stub, other, "node", _cred("node"), observer=True)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


# ---- identity ---------------------------------------------------------------------------
def test_an_island_cannot_act_as_another_and_the_attempt_is_taped(toy_layout, tmp_path):
    """A second Join as an existing id used to take its place; now it needs that id's
    credential. The island itself, restarted with its own credential, takes over."""
    with running_syncer(quorum=1, token=SECRET, state_dir=tmp_path / "s") as (run, addr):
        a, = _started(addr, toy_layout, ["a"])
        stub = _stub(addr)
        for cred in (_cred("mallory"), "isl1:a:" + "0" * 64, "garbage", None):
            with pytest.raises(grpc.RpcError) as e:
                _join(stub, toy_layout, "a", cred)
            assert e.value.code() in (grpc.StatusCode.PERMISSION_DENIED,
                                      grpc.StatusCode.UNAUTHENTICATED)
        gen = a.generation
        with pytest.raises(grpc.RpcError) as e:  # a push in a's name with mallory's credential
            _push(stub, _cred("mallory"), b"\0" * 4 * toy_layout.numel, learner_id="a",
                  generation=gen, numel=toy_layout.numel)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert run.members.rows["a"].generation == gen  # a kept its place
        # a restart of a with its own credential takes over; the old connection is stale
        again = _join(stub, toy_layout, "a", _cred("a"))
        assert again.generation != gen and run.members.rows["a"].generation == again.generation
        a.close()
    denied = [r for r in read_tape(tmp_path / "s" / "tape.jsonl")
              if r["event"] == "rejected" and r["kind"].endswith(":denied")]
    assert {r["learner"] for r in denied} == {"mallory"} and len(denied) == 2


def test_claimed_tokens_are_bounded_by_the_declaration(toy_layout):
    """A push claiming 999,999 loss tokens used to get a merge share of 1.0."""
    n = toy_layout.numel
    with running_syncer(quorum=2, token=SECRET) as (run, addr):
        stub, joined = _stub(addr), []
        honest, = _started(addr, toy_layout, ["honest"], then=lambda: joined.append(
            _join(stub, toy_layout, "rogue", _cred("rogue"), tokens_per_step=2048)))
        gen = joined[0].generation
        payload = np.full(n, 0.5, np.float32).tobytes()
        for tokens, steps in ((999_999, 50), (10, 100_001)):
            with pytest.raises(grpc.RpcError) as e:
                _push(stub, _cred("rogue"), payload, learner_id="rogue", generation=gen,
                      numel=n, loss_tokens=tokens, steps=steps)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # a rejoin may not raise the declaration
            _join(stub, toy_layout, "rogue", _cred("rogue"), tokens_per_step=4096)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert _push(stub, _cred("rogue"), payload, learner_id="rogue", generation=gen, numel=n,
                     loss_tokens=50 * 2048, steps=50).accepted
        honest.close()


@pytest.mark.parametrize("shape, why", [
    ((3, 0), "must be 1 to"), ((2**20, 2**20), "max-params"),
    ((2**32, 2**32, 4), "max-params"),  # 2^66 wraps to 0 in int64 (issue 44)
    ((2**31, 2**31, 2, 2), "max-params"),  # wraps to 0: passed --max-params
])
def test_the_first_layout_must_be_sane(shape, why):
    """The first island used to set any layout: 2^40 elements made the syncer allocate
    4 TiB for Θ; a shape whose product wraps in int64 passed --max-params."""
    with running_syncer(quorum=1) as (run, addr):
        req = pb.JoinRequest(learner_id="a", fingerprint="x",
                             layout=[pb.TensorSpec(name="w", shape=list(shape), dtype="float32")])
        with pytest.raises(grpc.RpcError) as e:
            _stub(addr).Join(req, timeout=20)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in e.value.details()
        assert run.layout is None


# ---- resources --------------------------------------------------------------------------
def _silent_push(stub, header, release: threading.Event, errors: list, credential=None):
    """A push stream that sends `header` (or nothing) and then nothing until `release`."""
    def chunks():
        if header is not None:
            yield pb.PushChunk(header=header)
        release.wait(120)

    def call():
        try:
            stub.Push(chunks(), metadata=net.auth_metadata(credential), timeout=120)
        except grpc.RpcError as e:
            errors.append(e.code())

    t = threading.Thread(target=call, daemon=True)
    t.start()
    return t


def test_silent_push_streams_are_cancelled_and_free_their_slots(toy_layout):
    """Four pushes that sent a header and then nothing used to fill every in-flight slot
    for good: nobody else could push and no round committed."""
    n = toy_layout.numel
    run = Run(Config(quorum=1))
    server, port = serve(run, "127.0.0.1", 0, max_inflight_pushes=4,
                         streams=Streams(idle_s=1.0))
    addr, release, errors = f"127.0.0.1:{port}", threading.Event(), []
    try:
        a, = _started(addr, toy_layout, ["a"], token=None)
        header = pb.PushHeader(learner_id="a", generation=a.generation, round=1,
                               base_version=0, loss_tokens=1, steps=1, encoding="f32",
                               numel=n, payload_bytes=4 * n, seq=0)
        threads = [_silent_push(_stub(addr), header, release, errors) for _ in range(4)]
        for t in threads:  # each ends when the syncer cancels it for its silence
            t.join(60)
        assert len(errors) == 4 and set(errors) == {grpc.StatusCode.CANCELLED}, errors
        r = a.push(codec.encode(np.ones(n, np.float32), "f32"), encoding="f32",
                   base_version=0, loss_tokens=3, steps=1, seq=0).result(60)
        assert r.accepted and a.wait_one(timeout=30).version == 1
        a.close()
    finally:
        release.set()
        server.ticker_stop.set()
        server.stop(grace=0).wait()


def test_one_island_holds_one_push_slot_however_many_streams_it_opens(toy_layout):
    """A rogue's silent pushes used to take all four push slots until their idle
    deadline: honest islands could not push meanwhile, again and again."""
    n = toy_layout.numel
    run = Run(Config(quorum=2))
    server, port = serve(run, "127.0.0.1", 0, token=SECRET, max_inflight_pushes=4,
                         streams=Streams(idle_s=600.0))  # silence is never cut off here
    addr, release, errors = f"127.0.0.1:{port}", threading.Event(), []
    try:
        stub, joined = _stub(addr), []
        honest, = _started(addr, toy_layout, ["honest"], then=lambda: joined.append(
            _join(stub, toy_layout, "rogue", _cred("rogue"))))
        header = pb.PushHeader(learner_id="rogue", generation=joined[0].generation, round=1,
                               base_version=0, loss_tokens=1, steps=1, encoding="f32",
                               numel=n, payload_bytes=4 * n, seq=0)
        for _ in range(4):
            _silent_push(_stub(addr), header, release, errors, _cred("rogue"))
        # all but one are refused at once (one push per island); which one holds the
        # slot is the server's order of arrival
        assert wait_until(lambda: len(errors) >= 3, timeout=60), errors
        assert errors.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 3, errors
        r = honest.push(codec.encode(np.ones(n, np.float32), "f32"), encoding="f32",
                        base_version=0, loss_tokens=3, steps=1, seq=0).result(60)
        assert r.accepted  # a slot was free for it while the rogue's push stayed silent
        honest.close()
    finally:
        release.set()
        server.ticker_stop.set()
        server.stop(grace=0).wait()


def test_silent_streams_cannot_starve_join_and_status(toy_layout):
    """Seventy streams that send nothing used to take every worker thread: Status and
    Join timed out."""
    with running_syncer(quorum=1) as (run, addr):
        release, errors = threading.Event(), []
        threads = [_silent_push(_stub(addr), None, release, errors) for _ in range(70)]
        try:
            s = _stub(addr).Status(pb.StatusRequest(), timeout=30)
            assert s.quorum == 1
            assert _join(_stub(addr), toy_layout, "a", None).generation > 0
        finally:
            release.set()
            for t in threads:
                t.join(60)


# ---- durable commits --------------------------------------------------------------------
def test_a_commit_is_a_commit_only_once_on_disk(toy_layout, tmp_path):
    """A save that failed (a full disk) used to kill the commit thread: the version
    advanced in memory, unsaved, untaped, unbroadcast, and nothing committed again."""
    n = toy_layout.numel
    state_dir = tmp_path / "state"
    with running_syncer(quorum=1, state_dir=state_dir) as (run, addr):
        a, = _started(addr, toy_layout, ["a"], token=None)
        a.push(codec.encode(np.ones(n, np.float32), "f32"), encoding="f32", base_version=0,
               loss_tokens=3, steps=1, seq=0).result(20)
        assert a.wait_one(timeout=30).version == 1
        saved = state_dir / state.STATE_FILE
        saved.unlink()
        saved.mkdir()  # a folder where the state goes: every save fails, as on a broken disk
        a.push(codec.encode(np.ones(n, np.float32), "f32"), encoding="f32", base_version=1,
               loss_tokens=3, steps=1, seq=1).result(20)
        with run.cond:  # the round merged, but it is not committed: nothing was saved
            assert run.committer.pending is not None and run.version == 1
        status = _stub(addr).Status(pb.StatusRequest(), timeout=20)
        assert status.version == 1 and "cannot save" in status.problem
        with pytest.raises(grpc.RpcError) as e:  # pushes wait for the save
            _push(_stub(addr), None, np.ones(n, np.float32).tobytes(), learner_id="a",
                  generation=a.generation, numel=n, round=2, base_version=1, seq=2)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        saved.rmdir()  # the disk is back: the retry commits round 2
        got = a.wait_one(timeout=60)
        assert got.version == 2
        a.close()
    saved = state.load(state_dir)[3]
    assert saved["version"] == 2
    assert [r["version"] for r in read_tape(state_dir / "tape.jsonl")
            if r["event"] == "merge"] == [1, 2]


def test_a_save_that_keeps_failing_stops_the_syncer(toy_layout, tmp_path):
    n = toy_layout.numel
    state_dir = tmp_path / "state"
    with running_syncer(quorum=1, state_dir=state_dir, save_timeout_s=0.0) as (run, addr):
        a, = _started(addr, toy_layout, ["a"], token=None)
        (state_dir / state.STATE_FILE).mkdir(parents=True)  # every save fails
        a.push(codec.encode(np.ones(n, np.float32), "f32"), encoding="f32", base_version=0,
               loss_tokens=3, steps=1, seq=0).result(20)
        with run.cond:
            assert run.fatal and "--resume" in run.fatal and run.version == 0
        a.close()


def test_changed_metadata_in_the_state_file_is_refused(toy_layout, tmp_path):
    """A changed digit in the state's metadata (version, last_seq) used to load silently
    (the digests covered the tensors only)."""
    state_dir = tmp_path / "state"
    with running_syncer(quorum=1, state_dir=state_dir) as (run, addr):
        a, = _started(addr, toy_layout, ["a"], token=None)
        a.push(codec.encode(np.ones(toy_layout.numel, np.float32), "f32"), encoding="f32",
               base_version=0, loss_tokens=3, steps=1, seq=0).result(20)
        assert a.wait_one(timeout=30).version == 1
        a.close()
    path = state_dir / state.STATE_FILE
    data = path.read_bytes()
    assert b'\\"last_seq\\": 0' in data
    path.write_bytes(data.replace(b'\\"last_seq\\": 0', b'\\"last_seq\\": 9', 1))
    with pytest.raises(state.StateError, match="metadata"):
        Run(Config(quorum=1, state_dir=state_dir, resume=True))
    assert state_dir.stat().st_mode & 0o777 == 0o700


# ---- issue 44: output file names are bare names -------------------------------------------
@pytest.mark.parametrize("weights_file,export_files", [
    ("/tmp/yeto-escape.safetensors", {}),                         # absolute
    ("../../escape.safetensors", {}),                              # out of final/
    ("sub/dir.safetensors", {}),                                   # a folder
    ("adapter_model.safetensors", {"adapter_model.safetensors": "x"}),  # replaces the weights
    ("adapter_model.safetensors", {"provenance.json": "{}"}),     # the syncer's own file
    ("adapter_model.safetensors", {"..": "x"}),
    ("weights.safetensors\n", {}),                                 # forges a log line
])
def test_an_island_cannot_name_a_file_outside_final_or_replace_one(toy_layout, tmp_path,
                                                                   weights_file, export_files):
    """JoinRequest.weights_file and export_files were joined onto final/ unchecked: an
    absolute path or `..` made Finish write Θ anywhere the syncer could write. Now the
    join is refused (INVALID_ARGUMENT) through the real server and nothing changes."""
    with running_syncer(quorum=1, token=SECRET, state_dir=tmp_path / "s") as (run, addr):
        digest = run.state_digest()
        with pytest.raises(grpc.RpcError) as e:
            _join(_stub(addr), toy_layout, "rogue", _cred("rogue"), weights_file=weights_file,
                  export_files=export_files)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert "file name" in e.value.details() or "twice" in e.value.details()
        assert run.state_digest() == digest and run.layout is None
        # an honest island then joins and names the run's files
        ok = _join(_stub(addr), toy_layout, "honest", _cred("honest"),
                   weights_file="adapter_model.safetensors",
                   export_files={"adapter_config.json": "{}"})
        assert ok.generation and run.weights_file == "adapter_model.safetensors"


def test_a_refused_layout_leaves_the_run_s_output_files_as_they_were(toy_layout):
    """A joiner with another layout used to replace the run's output files before its
    layout was refused."""
    other = type(toy_layout).from_shapes({"x.lora_A.weight": (2, 3)})
    with running_syncer(quorum=2, token=SECRET) as (run, addr):
        stub = _stub(addr)
        _join(stub, other, "first", _cred("first"), weights_file="adapter_model.safetensors")
        with pytest.raises(grpc.RpcError) as e:
            _join(stub, toy_layout, "second", _cred("second"), weights_file="elsewhere.bin",
                  export_files={"adapter_config.json": "{}"})
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert run.weights_file == "adapter_model.safetensors" and run.model.export_files == {}


def test_a_finish_that_cannot_build_final_fails_the_run_loudly(toy_layout, tmp_path):
    """A malformed frozen-A file made Finish fail with UNKNOWN, no final/, and the syncer
    exited 0 (issue 44). Now the run fails (`python -m syncer` exits 1 with the reason)."""
    with running_syncer(quorum=1, token=SECRET, state_dir=tmp_path / "s") as (run, addr):
        client = make_client(addr, "a", toy_layout, token=_cred("a"),
                             export_files={"yeto_frozen_a.json": "{not json"})
        try:
            client.start(np.zeros(toy_layout.numel, np.float32))
            assert wait_until(lambda: run.started)
            try:
                client.finish()
            except grpc.RpcError:
                pass  # the syncer fails the run; what the island hears of it does not matter
            assert wait_until(lambda: run.fatal is not None)
        finally:
            client.close()
        assert "cannot build the final weights" in run.fatal
        assert not (tmp_path / "s" / "final" / "adapter_model.safetensors").exists()


@pytest.mark.parametrize("learner,backend", [("island-0\n", "torch"),
                                             ("island-0", "torch\nINFO forged"),
                                             ("island-0", "\x1b[2Jmlx")])
def test_ids_and_backends_cannot_forge_log_lines_or_terminal_escapes(toy_layout, learner,
                                                                     backend):
    """An id with a trailing newline passed the id check (`$` matches before it) and the
    backend was not checked: both went raw into logs, the tape and `yeto status`."""
    with running_syncer(quorum=1) as (run, addr):
        with pytest.raises(grpc.RpcError) as e:
            _join(_stub(addr), toy_layout, learner, None, backend=backend)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert not run.members.rows and run.layout is None


def test_a_rogue_joining_mid_round_cannot_escape_the_share_cap(toy_layout, tmp_path):
    """Whether a round could be capped was decided when it opened (from the islands
    live then): a rogue that joined after round 1 opened beside two islands took a share
    of 1.0 with k = 3 (found by scripts/chaos.py). Now its pushes are kept from the
    moment it may push, and the cap applies; a push summed before keeps its weight."""
    n = toy_layout.numel
    with running_syncer(quorum=2, state_dir=tmp_path / "s", token=SECRET, **AVERAGING) as (
            run, addr):
        a, b = _started(addr, toy_layout, ["a", "b"])
        a.push(codec.encode(np.full(n, 0.1, np.float32), "f32"), encoding="f32",
               base_version=0, loss_tokens=10, steps=1, seq=0).result(20)  # summed: k = 2
        stub = _stub(addr)
        rogue = _join(stub, toy_layout, "rogue", _cred("rogue"))
        assert _push(stub, _cred("rogue"), np.full(n, -0.9, np.float32).tobytes(),
                     learner_id="rogue", generation=rogue.generation, numel=n,
                     loss_tokens=10_000, steps=1).accepted
        b.push(codec.encode(np.full(n, 0.2, np.float32), "f32"), encoding="f32",
               base_version=0, loss_tokens=10, steps=1, seq=0).result(20)
        theta = a.wait_one(timeout=30).theta
        for c in (a, b):
            c.close()
    want = -(10 * 0.1 + 10 * 0.2 + 40 * -0.9) / 60  # the rogue at 2/3 (weight 40)
    assert np.allclose(theta, want, rtol=1e-6)
    rec = _merges(tmp_path / "s")[0]
    assert {r["learner"]: r["share"] for r in rec["responders"]}["rogue"] == pytest.approx(2 / 3)


def test_a_trimmed_merge_drops_a_rogue_at_its_bound(toy_layout, rng, tmp_path):
    """Under `--merge trimmed` one rogue among four islands pushing huge values (summed
    at its norm bound, over 1,000 x the honest tokens) is the highest value of every
    coordinate and is dropped: Θ moves by the mean of the two upper honest values, as
    if the rogue had not pushed (issue 44: under the mean it holds half the merge)."""
    n = toy_layout.numel
    with running_syncer(quorum=4, merge="trimmed", state_dir=tmp_path / "s", **AVERAGING) as (
            run, addr):
        cs = _started(addr, toy_layout, ["a", "b", "c", "rogue"], token=None)
        honest = rng.uniform(-0.01, 0.01, (3, n)).astype(np.float32)
        for c, d in zip(cs, [*honest, np.full(n, 1e3, np.float32)]):  # the rogue last
            c.push(codec.encode(d, "f32"), encoding="f32", base_version=0,
                   loss_tokens=10_000 if c.learner_id == "rogue" else 10, steps=1,
                   seq=0).result(20)
        theta = cs[0].wait_one(timeout=30).theta
        for c in cs:
            c.close()
    upper = np.sort(honest, axis=0)[1:]  # per coordinate: the lowest honest one dropped
    want = -((upper[0].astype(np.float64) + upper[1]) / 2).astype(np.float32)
    assert np.array_equal(theta, want)
    rec = _merges(tmp_path / "s")[0]
    by = {r["learner"]: r for r in rec["responders"]}
    assert rec["merge_rule"] == "trimmed" and by["rogue"]["bound_scale"] < 1e-3
    assert 1e3 * by["rogue"]["bound_scale"] > 0.01  # still above every honest value


def test_an_island_cannot_fence_the_syncer_with_a_term_it_made_up():
    """Fencing (syncer.standby): a join carrying a newer term stops a syncer whose standby
    took over. With a run secret the term must carry the run's signature, which only a
    syncer that took the run over hands out: one valid credential and a made-up term
    fence nothing (the join is refused and the run goes on); the signed term fences."""
    from syncer.run import Config, Reject, Run
    from yeto import net
    from yeto.testing.synthetic import layout_for

    layout = layout_for(64)
    run = Run(Config(quorum=1, token="s3cret"))

    def join(term, proof):
        return run.join("a", layout.specs, layout.fingerprint, "numpy", "w.safetensors", {},
                        known_term=term, term_proof=proof)

    assert join(0, b"")["term"] == 0
    for proof in (b"", bytes(32), net.term_proof("another-secret", run.run_id, 7)):
        with pytest.raises(Reject) as e:
            join(7, proof)
        assert e.value.code == "invalid" and run.fatal is None
    with pytest.raises(Reject) as e:
        join(7, net.term_proof("s3cret", run.run_id, 7))
    assert e.value.code == "unavailable" and "fenced" in (run.fatal or "")
