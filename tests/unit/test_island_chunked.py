"""The island's chunked paths (range access to the weights, payloads encoded piece by
piece, broadcasts applied piece by piece or as they stream in) give bit-identical
results to the whole-array paths (get/set only), and to the documented math.

Here: the checks that need no process, server or training (the others:
tests/integration/test_island_chunked.py)."""


import numpy as np
import pytest
import torch
from helpers.island_chunked import OUTER_LR, FakeSyncer, FlatWeights, RangedWeights

from yeto import codec
from yeto.island import Island
from yeto.layout import Layout
from yeto.torch.weights import TorchWeights
from yeto.transport import Received, ThetaStream

# ---- weights objects ---------------------------------------------------------------


class ViewWeights(FlatWeights):
    """Range access whose reads are views of the weights (as yeto.testing.synthetic
    gives): the island computes in them, and a write of that same view copies nothing."""

    ranged = True

    def read_range(self, lo, hi):
        return self.v[lo:hi]

    def write_range(self, lo, hi, values):
        if not np.shares_memory(values, self.v[lo:hi]):
            self.v[lo:hi] = values


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 29), torch.nn.Linear(29, 7),
                               torch.nn.Linear(7, 3))


def torch_weights():
    return TorchWeights(small_model(), "full")


def run(weights, *, steps=24, fragments=1, delay=2, refuse=(), stream=None, chunk=64,
        wire="q4", **options):
    """Train `weights` towards a target (the same f32 ops for every weights object),
    syncing every 4 steps; returns (payloads, final weights, island)."""
    syncer = FakeSyncer(weights.layout, fragments, delay, refuse, stream)
    island = Island(weights, client=syncer, sync_every=4, wire=wire, chunk=chunk,
                                **options)
    island.start()
    target = np.linspace(-1, 1, weights.layout.numel, dtype=np.float32)
    for _ in range(steps):
        w = weights.get()
        weights.set(w - np.float32(0.05) * (w - target))
        syncer.clock += 1
        island.after_step(10, train_loss=1.0)
    assert island.finish()
    return syncer.payloads, weights.get(), island


# ---- the tests ---------------------------------------------------------------------
SCENARIOS = {
    "overlap": dict(),
    "alpha": dict(merge_alpha=0.3),
    "blocking": dict(blocking=True),
    "fragments": dict(fragments=3, pipeline=2, merge_alpha=0.25),
    "refused": dict(refuse={1, 4}),
    "bf16": dict(wire="bf16", merge_alpha=0.1),
    "f32 refused": dict(wire="f32", refuse={2}),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_chunked_equals_whole_arrays(name):
    """TorchWeights (range access per tensor, pieces of 64 crossing tensor bounds), a
    ranged numpy model and a get/set-only model give the same payloads, weights,
    anchor and residual, bit for bit; so do broadcasts streamed in odd pieces."""
    opts = SCENARIOS[name]
    layout = torch_weights().layout
    init = torch_weights().get()
    whole = run(FlatWeights(layout, init), threads=1, **opts)
    for weights, extra in ((torch_weights(), dict(threads=1)), (RangedWeights(layout, init), {}),
                           (torch_weights(), dict(threads=4)),
                           (ViewWeights(layout, init), dict(threads=2)),
                           (torch_weights(), dict(stream=37, chunk=128)),
                           (FlatWeights(layout, init), dict(chunk=1 << 20))):
        got = run(weights, **{**opts, **extra})
        assert len(got[0]) == len(whole[0]) >= 6
        assert all(a == b for a, b in zip(got[0], whole[0]))
        assert got[1].tobytes() == whole[1].tobytes()
        assert got[2].encoder.anchor.tobytes() == whole[2].encoder.anchor.tobytes()
        for r1, r2 in ((got[2].encoder.feedback.residual, whole[2].encoder.feedback.residual),):
            assert (r1 is None) == (r2 is None) and (r1 is None or r1.tobytes() == r2.tobytes())
    # the island ends on the syncer's final Θ exactly
    assert whole[1].tobytes() == whole[2].encoder.anchor.tobytes()


def reference(layout, init, steps=24, merge_alpha=0.0, delay=2):
    """The documented math on whole arrays, as the island did it before it went chunk
    by chunk (`base`: Θ, or the weights at the push while its round is open, kept
    beside Θ; the residual): the payloads an island must send."""
    local, base = init.copy(), init.copy()
    residual = np.zeros(layout.numel, np.float32)
    theta, pending, payloads = init.copy(), [], []
    target = np.linspace(-1, 1, layout.numel, dtype=np.float32)
    for step in range(1, steps + 1):
        local = local - np.float32(0.05) * (local - target)
        for _, th in [p for p in pending if p[0] <= step]:
            merged = th + (local - base)
            if merge_alpha:
                merged = merge_alpha * local + (1 - merge_alpha) * merged
            local, base = merged, th.copy()
            pending = [p for p in pending if p[0] > step]
        if step % 4 == 0:
            t = residual + (base - local)
            payload = codec.encode(t, "q4")
            residual = t - codec.decode(payload, "q4", t.size)
            payloads.append(payload)
            base = local.copy()
            theta = theta - np.float32(OUTER_LR) * codec.decode(payload, "q4", t.size)
            pending.append((step + delay, theta.copy()))
    return payloads


@pytest.mark.parametrize("alpha", [0.0, 0.3])
def test_chunked_island_sends_what_the_math_says(alpha):
    layout = torch_weights().layout
    payloads, _, _ = run(torch_weights(), merge_alpha=alpha)
    want = reference(layout, torch_weights().get(), merge_alpha=alpha)
    assert payloads[:len(want)] == want and len(want) == 6


def test_refused_push_is_carried_into_the_next_one():
    """A refused push's work reaches the syncer with the next push: what it decodes to
    is the island's whole change since Θ, within one q4 step."""
    w = torch_weights()
    init = w.get()
    syncer = FakeSyncer(w.layout, delay=100, refuse={0})
    island = Island(w, client=syncer, sync_every=4, chunk=64)
    island.start()
    for _ in range(8):
        w.set(w.get() * np.float32(0.9) + np.float32(0.01))
        island.after_step(10)
    assert len(syncer.payloads) == 2 and island.ledger.tokens[0] == 0
    change = init - w.get()
    sent = codec.decode(syncer.payloads[1], "q4", w.layout.numel)
    assert np.all(np.abs(sent - change) <= 2 * codec.q4_error_bound(change) + 1e-7)
    assert island.encoder.anchor.tobytes() == w.get().tobytes()  # the anchor moved to the push


def test_stream_that_breaks_off_is_applied_in_part_then_whole():
    """A streamed broadcast that breaks off leaves the applied pieces applied; the next
    broadcast of that fragment is applied even with the same version."""
    layout = Layout.from_shapes({"a": (300,)})
    w = RangedWeights(layout, np.zeros(300, np.float32))
    syncer = FakeSyncer(layout)
    island = Island(w, client=syncer, sync_every=100, chunk=64)
    island.start()
    assert island.version == 0
    broken = ThetaStream(300, depth=10)
    broken.put(np.ones(100, np.float32))
    broken.fail("connection reset")
    island._apply_all([Received(1, 0, False, broken)])
    assert island.version == 0 and (w.v[:100] == 1).all() and (w.v[100:] == 0).all()
    again = np.full(300, 2.0, np.float32)
    island._apply_all([Received(0, 0, False, again)])  # same version as held: applied
    assert island.version == 0 and (w.v == 2).all() and (island.encoder.anchor == 2).all()
    assert w.flushes >= 3


def test_encoder_pieces_equal_whole_encode():
    rng = np.random.default_rng(3)
    for enc in codec.ENCODINGS:
        for n in (1, 64, 1000, 70_001):
            x = rng.standard_normal(n).astype(np.float32)
            e = codec.Encoder(enc, n)
            for lo in range(0, n, 192):
                e.put(lo, x[lo:lo + 192])
            assert e.buffer.tobytes() == codec.encode(x, enc)
            d = codec.decode(codec.encode(x, enc), enc, n)
            assert all(np.array_equal(e.decoded(lo, min(lo + 128, n)), d[lo:lo + 128])
                       for lo in range(0, n, 128))


@pytest.mark.parametrize("threads", [1, 3])
def test_non_finite_weights_refuse_to_push_and_lose_nothing(threads):
    layout = Layout.from_shapes({"a": (256,)})
    w = RangedWeights(layout, np.zeros(256, np.float32))
    syncer = FakeSyncer(layout)
    island = Island(w, client=syncer, sync_every=1, chunk=64, threads=threads)
    island.start()
    w.v[:] = 0.5
    w.v[200] = np.nan
    with pytest.raises(codec.CodecError):
        island.after_step(1)
    # the first three pieces were encoded, then carried back: the residual holds their
    # work (up to q4 rounding), and the anchor moved past them
    assert np.allclose(island.encoder.feedback.residual[:192], -0.5, atol=0.5 / 14)
    assert (island.encoder.anchor[:192] == 0.5).all() and (island.encoder.anchor[192:] == 0).all()
    assert not syncer.payloads


@pytest.mark.parametrize("threads", [1, 4])
def test_non_finite_piece_mid_push_loses_nothing_whatever_the_threads(threads):
    """A NaN in the second of eight pieces: the pieces encoded meanwhile (in order, or
    also after it on other threads) are carried back; for every value the work the
    syncer does not hold, (anchor − local) + residual, is still the whole change."""
    n = 512
    layout = Layout.from_shapes({"a": (n,)})
    w = RangedWeights(layout, np.zeros(n, np.float32))
    syncer = FakeSyncer(layout)
    island = Island(w, client=syncer, sync_every=1, chunk=64, threads=threads)
    island.start()
    w.v[:] = np.linspace(0.1, 0.9, n, dtype=np.float32)
    change = island.encoder.anchor - w.v
    w.v[100] = np.nan
    with pytest.raises(codec.CodecError):
        island.after_step(1)
    owed = (island.encoder.anchor - w.v) + island.encoder.feedback.residual
    ok = np.arange(n) != 100
    moved = island.encoder.anchor[ok] != 0
    assert moved[:64].all() and not moved[64:127].any()  # piece 0 carried, piece 1 not
    np.testing.assert_allclose(owed[ok], change[ok], atol=0.9 / 14)
    assert not syncer.payloads


def test_non_finite_value_inside_a_piece_carries_back_its_encoded_part():
    """A piece longer than one q4 chunk is encoded a chunk at a time: a NaN in its
    second chunk carries the first back (anchor moved, work in the residual) and
    leaves the rest as it was; nothing of the change is lost."""
    n = 5 * codec.CHUNK // 2
    layout = Layout.from_shapes({"a": (n,)})
    w = RangedWeights(layout, np.zeros(n, np.float32))
    syncer = FakeSyncer(layout)
    island = Island(w, client=syncer, sync_every=1, threads=1)
    island.start()
    w.v[:] = np.linspace(-1, 1, n, dtype=np.float32)
    change = island.encoder.anchor - w.v
    bad = 3 * codec.CHUNK // 2
    w.v[bad] = np.nan
    with pytest.raises(codec.CodecError):
        island.after_step(1)
    moved = island.encoder.anchor != 0
    assert moved[:codec.CHUNK].all() and not moved[codec.CHUNK:].any()
    assert not island.encoder.feedback.residual[codec.CHUNK:].any()
    ok = np.arange(n) != bad
    owed = (island.encoder.anchor - w.v) + island.encoder.feedback.residual
    np.testing.assert_allclose(owed[ok], change[ok], atol=1 / 14)
    assert not syncer.payloads
