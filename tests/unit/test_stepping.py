"""The outer step behind its broadcast (syncer.stepping): the broadcast's first chunks
can be read while the step still holds later ones, the last byte waits for the
commit, a push waits for the step instead of being refused, the weights are those of
a commit made whole, and a step that fails wakes its readers with an error."""

import threading

import numpy as np
import pytest
from helpers.wait import wait_until

from syncer import merge
from syncer.messages import PushHeader
from syncer.run import Config, Reject, Run
from syncer.staging import WholePush
from syncer.stepping import Filling, StepFailed
from syncer.strategy import Nesterov
from yeto import codec, net
from yeto.codec import CHUNK
from yeto.layout import Layout
from yeto.proto import yeto_pb2 as pb

LAYOUT = Layout.from_shapes({"w": (8, CHUNK)})  # eight chunks of the step
HELD_FROM = 2 * CHUNK  # the gated rule holds every chunk from here until released


class Gated(Nesterov):
    """Nesterov whose chunks from HELD_FROM on wait for `release` (or turn non-finite
    with `poison`): the step stands still midway, where the test can look."""

    def __init__(self, theta_base: int, poison: bool = False):
        super().__init__(0.7, 0.9)
        self.base, self.poison = theta_base, poison
        self.release = threading.Event()
        self.release.set()

    def step(self, theta, m, g, t=1, divisor=1.0):
        lo = (theta.__array_interface__["data"][0] - self.base) // 4  # its first value
        if lo >= HELD_FROM:
            if self.poison:
                theta[0] = np.inf
                return False
            assert self.release.wait(60), "the test never released the step"
        return super().step(theta, m, g, t, divisor)


@pytest.fixture(autouse=True)
def _small_pieces(monkeypatch):
    """The step in pieces of one chunk (its default piece is larger than LAYOUT)."""
    monkeypatch.setattr(merge, "STEP_PIECE", CHUNK)


def _header(kind, seq=0, round_=0, base=0, gen=1, encoding="f32"):
    return PushHeader.from_pb(pb.PushHeader(
        learner_id="a", generation=gen, kind=kind, encoding=encoding, numel=LAYOUT.numel,
        payload_bytes=codec.encoded_size(encoding, LAYOUT.numel), round=round_,
        base_version=base, seq=seq, loss_tokens=10, steps=1))


def _started(overlap: bool, poison: bool = False) -> tuple[Run, int]:
    run = Run(Config(quorum=1, outer="nesterov", outer_lr=0.7, outer_momentum=0.9))
    if overlap:
        run.overlap_steps()
    gen = run.join("a", LAYOUT.specs, LAYOUT.fingerprint, "numpy", "w.safetensors", {})[
        "generation"]
    theta0 = np.random.default_rng(0).standard_normal(LAYOUT.numel).astype(np.float32)
    run.push(_header(pb.SEED, gen=gen), WholePush(codec.encode(theta0, "f32")))
    if overlap:
        run.model.outer = Gated(run.theta.__array_interface__["data"][0], poison)
    return run, gen


def _delta(seed: int) -> bytes:
    return codec.encode(np.random.default_rng(seed).standard_normal(LAYOUT.numel)
                        .astype(np.float32) * 1e-2, "f32")


def _push(run, gen, seq):
    return run.push(_header(pb.DELTA, seq=seq, round_=seq, base=seq - 1, gen=gen),
                    WholePush(_delta(seq)))


def test_filling_lets_a_prefix_through_and_holds_the_last_byte():
    fill = Filling(40)
    fill.done(10, 20)  # out of order: nothing readable yet
    with pytest.raises(StepFailed):
        fill.wait(10, timeout=0)
    fill.done(0, 10)
    fill.wait(20, timeout=0)
    fill.done(20, 40)
    fill.wait(39, timeout=0)
    with pytest.raises(StepFailed, match="did not reach byte 40"):
        fill.wait(40, timeout=0)  # the last byte waits for the commit
    fill.complete()
    fill.wait(40, timeout=0)
    fill.abort("boom")
    with pytest.raises(StepFailed, match="boom"):
        fill.wait(1, timeout=0)


def test_the_broadcast_streams_while_the_step_runs_and_ends_bit_identical():
    whole, wgen = _started(overlap=False)
    run, gen = _started(overlap=True)
    for seq in (1, 2):
        _push(whole, wgen, seq)
    assert whole.version == 2

    _push(run, gen, 1)  # round 1 is announced and steps behind its broadcast
    assert wait_until(lambda: run.version == 1)
    run.outer.release.clear()  # round 2's step stands still at HELD_FROM
    reply = {}
    before = run.theta.copy()
    _push_in_thread(run, gen, 2, reply)
    bc = run.downlink.latest[0]
    assert bc.version == 2 and run.committer.pending is not None
    reader = bc.source.open()
    first = bc.source.read(reader, 0, net.CHUNK_BYTES)  # stepped while the rest is held
    assert run.version == 1 and run.committer.pending.stepping
    round2 = whole.theta.tobytes()
    assert first == round2[:net.CHUNK_BYTES]
    assert not np.array_equal(before[:HELD_FROM], run.theta[:HELD_FROM])
    with pytest.raises(StepFailed):  # the last byte waits for the commit
        bc.source.filling.wait(bc.source.size, timeout=0)

    third = _push_in_thread(run, gen, 3, reply)  # waits for the step, is not refused
    assert wait_until(lambda: len(run.cond._waiters) > 0)  # (it is in check_saved's wait)
    run.outer.release.set()
    third.join(60)
    assert reply[3]["accepted"] and reply[3]["round"] == 3, reply
    assert wait_until(lambda: run.version == 3)
    _push(whole, wgen, 3)
    np.testing.assert_array_equal(run.theta, whole.theta)  # the same bits as whole commits
    rest = bc.source.read(reader, net.CHUNK_BYTES, bc.source.size)  # (kept for this reader)
    assert first + rest == round2


def _push_in_thread(run, gen, seq, reply) -> threading.Thread:
    def push():
        try:
            reply[seq] = _push(run, gen, seq)
        except Reject as e:
            reply[seq] = dict(accepted=False, round=-1, why=str(e))

    thread = threading.Thread(target=push)
    thread.start()
    if seq == 2:
        thread.join(60)  # the commit is announced inside this push; the step runs on
    return thread


def test_a_step_that_turns_non_finite_fails_the_run_before_any_island_has_it():
    run, gen = _started(overlap=True, poison=True)
    version = run.version
    _push(run, gen, 1)
    bc = run.downlink.latest[0]
    assert wait_until(lambda: run.fatal is not None)
    assert "non-finite" in run.fatal and "no --state-dir" in run.fatal
    assert run.version == version and bc.version == version + 1
    reader = bc.source.open()
    with pytest.raises(StepFailed, match="non-finite"):  # nothing more goes out
        bc.source.read(reader, 0, net.CHUNK_BYTES)
    with pytest.raises(Reject, match="stopping"):
        _push(run, gen, 2)


def test_a_commit_that_fails_after_its_step_fails_the_run_loudly(monkeypatch):
    died = []  # the thread's end, seen here (in the syncer, die_with_threads exits)
    monkeypatch.setattr(threading, "excepthook", died.append)
    run, gen = _started(overlap=True)

    def broken(record):
        raise OSError("the tape's disk is gone")

    run.tape.write = broken
    _push(run, gen, 1)
    bc = run.downlink.latest[0]
    assert wait_until(lambda: run.fatal is not None and died)
    assert "after its step" in run.fatal and "tape's disk" in run.fatal
    assert isinstance(died[0].exc_value, OSError)
    with pytest.raises(StepFailed, match="tape's disk"):  # its last byte never goes out
        bc.source.read(bc.source.open(), 0, bc.source.size)
