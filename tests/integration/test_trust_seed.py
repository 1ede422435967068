"""Who seeds Θ, against a peer holding a valid credential (issue 44, trust round two):
each island declares the digest of its initial weights at join, the seed must be the
weights its sender declared, and the first quorum outvotes a seed its majority did not
start from. Through real in-process gRPC syncers and real clients.

The first round of these checks (only the first joiner is asked; observers never fix the
layout): tests/integration/test_trust.py, whose helpers this uses."""


import grpc
import numpy as np
import pytest
from helpers.syncer import make_client, running_syncer

from integration.test_trust import SECRET, _cred, _join, _push, _stub
from syncer.model import Model, Restored
from syncer.shards import Shard
from syncer.strategy import Nesterov
from syncer.tape import read_tape
from yeto.client.sender import seed_sha256
from yeto.layout import Layout
from yeto.proto import yeto_pb2 as pb


def _rogue_joins(stub, layout, declared):
    """The rogue joins first, declaring `declared` as its initial weights: it is asked
    for the seed."""
    joined = _join(stub, layout, "rogue", _cred("rogue"), init_sha256=seed_sha256(declared))
    assert joined.send_seed
    return joined


def _clients(addr, layout, initials):
    """Real clients, started in order, each with its own initial weights."""
    out = []
    for lid, initial in initials:
        c = make_client(addr, lid, layout, token=SECRET)
        c.start(initial)
        assert c.connected.wait(30), c.last_error
        out.append(c)
    return out


def test_a_rogue_that_seeds_first_is_outvoted_by_the_first_quorum(toy_layout, tmp_path):
    """The first island to join seeded Θ, whatever the others started from: a rogue
    that joined first seeded the run with its own weights. Now the first quorum's
    declared digests are compared before round 1: two honest islands of three declared
    other weights, so Θ is unseeded and the earliest of them is asked (its broadcast
    stream tells it to join again), and every island starts from the honest weights."""
    n = toy_layout.numel
    honest, bogus = np.full(n, 0.25, np.float32), np.full(n, 5.0, np.float32)
    with running_syncer(quorum=3, token=SECRET, state_dir=tmp_path / "s") as (run, addr):
        stub = _stub(addr)
        rogue = _rogue_joins(stub, toy_layout, declared=bogus)
        assert _push(stub, _cred("rogue"), bogus.tobytes(), learner_id="rogue",
                     generation=rogue.generation, numel=n, kind=pb.PushKind.SEED).accepted
        cs = _clients(addr, toy_layout, [("honest-0", honest), ("honest-1", honest)])
        try:
            for c in cs:
                got = c.wait_one(timeout=60)
                assert got is not None and got.version == 0, c.last_error
                np.testing.assert_array_equal(got.theta, honest)
            np.testing.assert_array_equal(run.theta, honest)
        finally:
            for c in cs:
                c.close()
    tape = [r for r in _tape(tmp_path / "s") if r["event"] in ("seeded", "seed_vote")]
    assert [(r["event"], r.get("learner", r.get("seeder"))) for r in tape] == [
        ("seeded", "rogue"), ("seed_vote", "honest-0"), ("seeded", "honest-0")]


def test_a_seed_that_is_not_the_declared_weights_is_refused(toy_layout, tmp_path):
    """Digests are not secret: a rogue may declare the honest weights' digest and send
    other weights as the seed. That seed is refused (INVALID_ARGUMENT), the rogue is
    never asked again, and the next island to join seeds Θ."""
    n = toy_layout.numel
    honest, bogus = np.full(n, 0.25, np.float32), np.full(n, 5.0, np.float32)
    with running_syncer(quorum=2, token=SECRET, state_dir=tmp_path / "s") as (run, addr):
        stub = _stub(addr)
        rogue = _rogue_joins(stub, toy_layout, declared=honest)
        for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
            with pytest.raises(grpc.RpcError) as e:  # then: no longer the one asked
                _push(stub, _cred("rogue"), bogus.tobytes(), learner_id="rogue",
                      generation=rogue.generation, numel=n, kind=pb.PushKind.SEED)
            assert e.value.code() == code, e.value.details()
        assert run.theta is None
        c, = _clients(addr, toy_layout, [("honest-0", honest)])
        try:
            got = c.wait_one(timeout=60)
            assert got is not None and got.version == 0, c.last_error
            np.testing.assert_array_equal(got.theta, honest)
        finally:
            c.close()
    refused = [r for r in _tape(tmp_path / "s") if r["event"] == "seed_refused"]
    assert [(r["learner"], r["seeder"]) for r in refused] == [("rogue", "")]


def test_islands_that_start_from_different_weights_keep_the_first_seed(toy_layout, tmp_path):
    """No majority (torch beside MLX islands start from different LoRA draws): the first
    island's seed stands, as before the vote."""
    n = toy_layout.numel
    a, b = np.full(n, 0.25, np.float32), np.full(n, -0.5, np.float32)
    with running_syncer(quorum=2, token=SECRET, state_dir=tmp_path / "s") as (run, addr):
        cs = _clients(addr, toy_layout, [("torch-0", a), ("mlx-0", b)])
        try:
            for c in cs:
                got = c.wait_one(timeout=60)
                assert got is not None, c.last_error
                np.testing.assert_array_equal(got.theta, a)
        finally:
            for c in cs:
                c.close()
    assert not [r for r in _tape(tmp_path / "s") if r["event"] == "seed_vote"]


def test_the_vote_never_unseeds_a_theta_restored_from_the_state_dir():
    """A resumed run's Θ came from its state, not from a seed: no quorum replaces it."""
    layout = Layout.from_shapes({"w": (4,)})
    model = Model(1, Nesterov(1.0, 0.0))
    model.adopt("a", layout, "w.safetensors", {}, observer=False)
    model.choose_seeder("a")
    theta = np.ones(4, np.float32)
    assert model.seed("a", theta.tobytes(), seed_sha256(theta))
    other = seed_sha256(np.zeros(4, np.float32))
    assert model.vote([("a", seed_sha256(theta)), ("b", other), ("c", other)])
    assert model.theta is None and model.seeder == "b"
    restored = Model(1, Nesterov(1.0, 0.0))
    restored.restore(Restored(layout, theta.copy(), None, {}, "w.safetensors", {}))
    assert restored.vote([("b", other), ("c", other)]) == ""
    np.testing.assert_array_equal(restored.theta, theta)


def _tape(state_dir):
    return read_tape(state_dir / "tape.jsonl")


def test_a_shard_keeps_its_part_of_the_seed_and_checks_all_of_it(toy_layout):
    """A shard received the seed whole into one buffer, then kept its own fragments:
    each of S shards briefly held all of Θ. Now it keeps its fragments' bytes as they
    arrive (`syncer.staging.OwnedSeed`) and hashes every byte: a seed that differs
    from the declared weights only in another shard's fragment is still refused."""
    n = toy_layout.numel
    declared = np.linspace(-1, 1, n, dtype=np.float32)
    with running_syncer(quorum=1, token=SECRET, fragments=2, shard=Shard(0, 2)) as (run, addr):
        stub = _stub(addr)
        joined = _rogue_joins(stub, toy_layout, declared)
        (mine,) = run.owned()
        lo, hi = run.model.span(1 - mine)
        tampered = declared.copy()
        tampered[lo:hi] += 1.0  # only the fragment this shard does not keep
        with pytest.raises(grpc.RpcError) as e:
            _push(stub, _cred("rogue"), tampered.tobytes(), learner_id="rogue",
                  generation=joined.generation, numel=n, kind=pb.PushKind.SEED)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not the initial weights it declared" in e.value.details()
        assert run.model.theta is None
        honest = _join(stub, toy_layout, "honest", _cred("honest"),
                       init_sha256=seed_sha256(declared))
        assert honest.send_seed  # the rogue lost the seeding with its refused seed
        assert _push(stub, _cred("honest"), declared.tobytes(), learner_id="honest",
                     generation=honest.generation, numel=n, kind=pb.PushKind.SEED).accepted
        theta = run.model.the_theta
        mlo, mhi = run.model.span(mine)
        np.testing.assert_array_equal(theta[mlo:mhi], declared[mlo:mhi])
        assert not theta[lo:hi].any()
        assert run.model.seed_sha256 == seed_sha256(declared)
