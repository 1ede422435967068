"""The centre bound (syncer.bounds, "The centre"; `--center-factor`): in a round of three
or more islands, an island's push farther from the round's coordinate-wise median than
the factor × the other islands' typical distance from it is pulled in to that distance.
Its arithmetic (`center_scales`), and the accumulator that applies it chunk by chunk
(syncer.merge.MergeAccumulator) against numpy."""

import numpy as np
import pytest

from syncer.bounds import center_scales
from syncer.merge import MergeAccumulator
from yeto import codec
from yeto.codec.format import CHUNK


def test_an_island_is_measured_by_the_others_never_by_itself():
    scales, ratios = center_scales({"a": 1.0, "b": 1.2, "c": 0.9, "rogue": 50.0}, 3.0)
    # the rogue's bound: 3 × the lower median of (1.0, 1.2, 0.9) = 3.0
    assert scales["rogue"] == pytest.approx(3.0 / 50.0)
    assert ratios["rogue"] == pytest.approx(50.0)
    # an honest island's typical: the lower median of the other three, the rogue's
    # distance among them (a minority cannot raise it past the honest middle)
    assert ratios["b"] == pytest.approx(1.2 / 1.0) and scales["b"] == 1.0
    assert scales["a"] == scales["c"] == 1.0


@pytest.mark.parametrize("distances", [{"a": 1.0, "rogue": 99.0}, {"rogue": 99.0}])
def test_no_centre_for_fewer_than_three_islands(distances):
    assert center_scales(distances, 3.0) == (dict.fromkeys(distances, 1.0), {})


def test_a_factor_of_zero_is_off():
    assert center_scales({"a": 1.0, "b": 1.0, "rogue": 99.0}, 0.0)[0]["rogue"] == 1.0


def _accumulate(deltas, encoding, factor, tokens):
    n = deltas.shape[1]
    acc = MergeAccumulator(n, "mean", center_factor=factor)
    acc.expect(len(deltas))
    assert acc.keeps_pushes == (factor > 0)
    for i, (d, t) in enumerate(zip(deltas, tokens)):
        acc.add(codec.encode(d, encoding), encoding, loss_tokens=t, learner=f"i{i}")
    return acc, acc.result().copy()


def _honest(rng, k, n):
    consensus = rng.standard_normal(n).astype(np.float32)
    return consensus + 0.3 * rng.standard_normal((k, n)).astype(np.float32)


@pytest.mark.parametrize("encoding", ["f32", "bf16", "q4"])
def test_honest_islands_within_the_bound_merge_bit_for_bit_as_without_it(encoding):
    n = 2 * CHUNK + 100
    deltas = _honest(np.random.default_rng(3), 4, n)
    tokens = [100, 200, 300, 400]
    acc, with_bound = _accumulate(deltas, encoding, 3.0, tokens)
    _, without = _accumulate(deltas, encoding, 0.0, tokens)
    assert not acc.center_scales and len(acc.center_ratios) == 4
    assert max(acc.center_ratios.values()) < 3.0  # the margin the tape records
    assert np.array_equal(with_bound, without)


@pytest.mark.parametrize("encoding", ["f32", "q4"])
def test_a_push_far_from_the_median_is_pulled_in_to_the_bound(encoding):
    """3 honest islands and one 50× as far from their consensus, with the largest
    weight: the merge is Σ Wᵢ(c + sᵢ(rᵢ − c)) / Σ Wᵢ, the rogue's sᵢ bringing its
    distance from the median c to 3 × the others' lower median distance."""
    n = 2 * CHUNK + 100
    rng = np.random.default_rng(4)
    deltas = _honest(rng, 4, n)
    deltas[3] += 50.0 * rng.standard_normal(n).astype(np.float32)
    tokens = [100, 100, 100, 300]
    acc, got = _accumulate(deltas, encoding, 3.0, tokens)
    rows = np.stack([codec.decode(codec.encode(d, encoding), encoding, n)
                     for d in deltas]).astype(np.float64)
    c = np.median(rows, axis=0)
    dist = np.linalg.norm(rows - c, axis=1)
    typical = sorted(dist[:3])[1]  # the rogue's others: the three honest islands
    assert set(acc.center_scales) == {"i3"}
    s = acc.center_scales["i3"]
    assert s == pytest.approx(3.0 * typical / dist[3], rel=1e-4)
    pulled = rows.copy()
    pulled[3] = c + s * (rows[3] - c)
    want = (np.array(tokens, np.float64)[:, None] * pulled).sum(axis=0) / sum(tokens)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # the rogue's part of the merge sits at the bound: 3 × the typical honest distance
    assert np.linalg.norm(pulled[3] - c) == pytest.approx(3.0 * typical, rel=1e-4)
    # without the bound it would have dragged the merge far off
    _, unbounded = _accumulate(deltas, encoding, 0.0, tokens)
    assert np.linalg.norm(unbounded - c) > 10 * np.linalg.norm(got - c)
