"""The push leaves the training loop at once (issue 34): the island stages a push
(residual + anchor − local, the anchor moved: in the training thread, or with the
guard `Island.before_update` on the background thread while the loop computes its next
gradient) and encodes and sends it on a background thread while training goes on;
every step is pushed exactly once, and the bytes are those of a push encoded in the
training thread.

Here: a scripted transport (tests/helpers/island_chunked.py); the same island over a
real syncer: tests/integration/test_async_push.py."""

import threading

import numpy as np
import pytest
from helpers.island_chunked import FlatWeights, HeldSyncer, RangedWeights

from yeto import codec
from yeto.island import Island
from yeto.layout import Layout


def _layout(n=3000):
    return Layout.from_shapes({"a": (n // 3,), "b": (n // 3,), "c": (n - 2 * (n // 3),)})


def _train(island, weights, syncer, steps):
    """`steps` steps toward a target, each a read-only gradient pass, the guard, then
    the update; returns the sum of the steps' own changes."""
    target = np.linspace(-1, 1, weights.layout.numel, dtype=np.float32)
    work = np.zeros(weights.layout.numel)
    for _ in range(steps):
        before = weights.v.copy()
        grad = weights.v - target
        island.before_update()
        weights.v -= np.float32(0.05) * grad
        work += weights.v - before
        syncer.clock += 1
        island.after_step(10, train_loss=1.0)
    return work


def test_island_keeps_stepping_while_its_push_is_held_in_the_transport():
    layout = _layout()
    weights = RangedWeights(layout, np.zeros(layout.numel, np.float32))
    syncer = HeldSyncer(layout, delay=100)
    island = Island(weights, client=syncer, sync_every=4, chunk=256)
    island.start()
    syncer.gate.clear()
    _train(island, weights, syncer, 4)  # step 4 pushes: staged, handed to the background
    assert syncer.entered.wait(HeldSyncer.HOLD_S), "the push never reached the transport"
    _train(island, weights, syncer, 3)  # the push is still held: training goes on
    assert island.step == 7
    assert [p.seq for p in island.ledger.in_flight(0)] == [0]
    assert not island.ledger.in_flight(0)[0].future.done() and not syncer.payloads
    syncer.gate.set()
    assert island.ledger.in_flight(0)[0].future.result(HeldSyncer.HOLD_S).accepted
    assert len(syncer.payloads) == 1 and island.ledger.encode_s and island.blocked_s
    assert island.finish()


class SnapshotWeights(RangedWeights):
    """Range access plus `snapshot(lo, hi)` (as a CUDA model's view has: a copy the
    push is then staged from in the background), here a copy in memory."""

    snapshots = 0

    def snapshot(self, lo, hi):
        self.snapshots += 1
        copy = RangedWeights(self.layout, np.zeros(0, np.float32))
        copy.v = np.zeros(self.layout.numel, np.float32)
        copy.v[lo:hi] = self.v[lo:hi]
        return copy


def _guard(island):
    island.guard_updates(lambda before_update: True)  # `_train` calls it
    assert island.stager.deferred
    return island


def _run(overlap, *, fragments=1, refuse=(), wire="q4", steps=24, kind=RangedWeights,
         guarded=False):
    layout = _layout()
    weights = kind(layout, np.zeros(layout.numel, np.float32))
    syncer = HeldSyncer(layout, fragments=fragments, delay=1, refuse=refuse)
    island = Island(weights, client=syncer, sync_every=4, chunk=256, threads=2,
                    blocking=True, wire=wire, overlap=overlap)
    if guarded:
        _guard(island)
    island.start()
    _train(island, weights, syncer, steps)
    assert island.finish()
    if kind is SnapshotWeights:  # staged from a snapshot only when overlapped
        assert weights.snapshots == (island.pushes if overlap else 0)
    return syncer.payloads, weights.v.copy(), island


@pytest.mark.parametrize("options", [dict(), dict(fragments=3), dict(refuse={2}),
                                     dict(wire="bf16"), dict(wire="f32", refuse={1}),
                                     dict(kind=SnapshotWeights, fragments=3, refuse={2})])
def test_overlapped_push_is_bit_identical_to_the_push_in_the_training_thread(options):
    """Blocking sync (each push waits for its Θ): the same pushes, byte for byte, and
    the same final weights, whether the encode runs in the background or inline (or
    is staged in the background from a backend's snapshot); a refused push is carried
    into the next the same way."""
    inline, w_inline, a = _run(False, **options)
    overlapped, w_overlapped, b = _run(True, **options)
    assert len(inline) == len(overlapped) >= 6
    assert all(x == y for x, y in zip(inline, overlapped))
    assert w_inline.tobytes() == w_overlapped.tobytes()
    assert b.executor is not a.executor and a.pushes == b.pushes


@pytest.mark.parametrize("options", [dict(), dict(fragments=3, refuse={2}),
                                     dict(wire="f32", refuse={1}),
                                     dict(kind=FlatWeights, wire="bf16")])
def test_push_staged_behind_the_guard_is_bit_identical_to_staging_in_the_training_thread(
        options):
    """Staged on the background thread while the loop runs its read-only gradient pass,
    the guard before each update: the same pushes, byte for byte, and the same final
    weights as staged (and encoded) in the training thread."""
    inline, w_inline, a = _run(False, **options)
    deferred, w_deferred, b = _run(True, guarded=True, **options)
    assert len(inline) == len(deferred) >= 6 and b.stager.deferred
    assert all(x == y for x, y in zip(inline, deferred))
    assert w_inline.tobytes() == w_deferred.tobytes()


class HeldReads(RangedWeights):
    """Reads from any thread but the test's wait at `gate` once `hold` is set; `entered`
    is set when one does."""

    def __init__(self, *args):
        super().__init__(*args)
        self.hold, self.gate, self.entered = threading.Event(), threading.Event(), \
            threading.Event()

    def read_range(self, lo, hi):
        if self.hold.is_set() and threading.current_thread() is not threading.main_thread():
            self.entered.set()
            if not self.gate.wait(HeldSyncer.HOLD_S):
                raise TimeoutError("the held staging was never released")
        return super().read_range(lo, hi)


def test_loop_runs_its_gradient_pass_while_the_push_is_staged_and_the_guard_waits():
    layout = _layout()
    weights = HeldReads(layout, np.zeros(layout.numel, np.float32))
    syncer = HeldSyncer(layout, delay=100)
    island = _guard(Island(weights, client=syncer, sync_every=4, chunk=256))
    island.start()
    _train(island, weights, syncer, 3)
    weights.hold.set()
    _train(island, weights, syncer, 1)  # step 4 pushes: staged on the background thread
    assert weights.entered.wait(HeldSyncer.HOLD_S), "the staging never read the weights"
    [(staged, push)] = island.stager.pending
    anchor = island.encoder.anchor.copy()
    grad = weights.v - np.linspace(-1, 1, layout.numel, dtype=np.float32)  # it only reads
    assert not staged.done(), "the gradient pass waited for the staging"
    assert push is island.ledger.in_flight(0)[0] and not syncer.entered.is_set()
    returned = []
    guard = threading.Thread(target=lambda: returned.append(
        (island.before_update(), staged.done(), island.encoder.anchor.copy())))
    guard.start()
    weights.gate.set()
    guard.join(HeldSyncer.HOLD_S)
    assert returned and returned[0][1], "the guard returned before the push was staged"
    assert not np.array_equal(returned[0][2], anchor)  # the anchor moved to the weights
    np.testing.assert_array_equal(returned[0][2], weights.v)
    weights.v -= np.float32(0.05) * grad  # the update, once the guard let it
    island.after_step(10)
    assert syncer.entered.wait(HeldSyncer.HOLD_S) and island.finish()
    assert len(syncer.payloads) == 2  # step 4's push, and finish's push of step 5


def test_a_push_without_the_guard_is_staged_in_the_training_thread():
    layout = _layout()
    weights = HeldReads(layout, np.zeros(layout.numel, np.float32))
    syncer = HeldSyncer(layout, delay=100)
    island = Island(weights, client=syncer, sync_every=4, chunk=256)
    island.guard_updates(None)
    island.start()
    weights.hold.set()  # from here a read off the training thread waits for `gate`
    _train(island, weights, syncer, 4)
    assert not island.stager.deferred and not island.stager.pending
    assert not weights.entered.is_set() and island.pushes == 1
    np.testing.assert_array_equal(island.encoder.anchor, weights.v)
    weights.gate.set()
    assert island.finish()


@pytest.mark.parametrize("guarded", [False, True])
def test_every_step_is_pushed_exactly_once_while_pushes_overlap_training(guarded):
    """Non-blocking: Θ arrives while training goes on. The steps' own changes add up
    to what was pushed (Σ decoded pushes + the residual left, with the sign of
    anchor − local) plus what is not pushed yet (local − anchor): no step lost, none
    pushed twice."""
    layout = _layout()
    weights = RangedWeights(layout, np.zeros(layout.numel, np.float32))
    syncer = HeldSyncer(layout, delay=1)
    island = Island(weights, client=syncer, sync_every=4, chunk=256, overlap=True)
    if guarded:
        _guard(island)
    island.start()
    work = _train(island, weights, syncer, 22)
    island.ledger.settle(island.fragments, wait=True)
    pushed = sum(codec.decode(p, "q4", layout.numel).astype(np.float64)
                 for p in syncer.payloads)
    pushed += island.encoder.feedback.residual
    assert len(syncer.payloads) == 5
    np.testing.assert_allclose(work, -pushed + (weights.v - island.encoder.anchor), atol=1e-5)
    assert island.finish()


def test_non_finite_weights_stop_the_push_in_the_training_thread_when_overlapped():
    layout = Layout.from_shapes({"a": (256,)})
    w = RangedWeights(layout, np.zeros(256, np.float32))
    syncer = HeldSyncer(layout)
    island = Island(w, client=syncer, sync_every=1, chunk=64, overlap=True)
    island.start()
    w.v[:] = 0.5
    w.v[200] = np.nan
    with pytest.raises(codec.CodecError):
        island.after_step(1)
    assert not syncer.entered.is_set() and not island.ledger.pushed
    assert island.ledger.owes(0)  # the step stays owed: the next push carries it


def test_non_finite_weights_raise_at_the_guard_and_the_step_stays_owed():
    """Staged behind the guard: the error comes out of the guard, in the training thread,
    before the update; nothing is pushed and the step is owed."""
    layout = Layout.from_shapes({"a": (256,)})
    w = RangedWeights(layout, np.zeros(256, np.float32))
    syncer = HeldSyncer(layout)
    island = _guard(Island(w, client=syncer, sync_every=1, chunk=64, overlap=True))
    island.start()
    w.v[:] = 0.5
    w.v[200] = np.nan
    island.after_step(1)  # the push is staged in the background
    with pytest.raises(codec.CodecError):
        island.before_update()
    assert not syncer.payloads and not island.ledger.pushed and island.pushes == 0
    assert island.ledger.owes(0) and not island.stager.pending
