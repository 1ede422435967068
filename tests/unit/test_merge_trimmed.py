"""The trimmed-mean merge rule (`--merge trimmed`, syncer.strategy.TrimmedMean): its
coordinate-wise reduction against numpy, bit for bit, and the accumulator that feeds it
the kept pushes one chunk at a time (syncer.merge.MergeAccumulator)."""

import math

import numpy as np
import pytest

from syncer import strategy
from syncer.merge import MergeAccumulator
from syncer.run import Config, Run
from yeto import codec
from yeto.codec.format import CHUNK


def _reference(rows: np.ndarray, trim: int) -> np.ndarray:
    """Column by column: sorted, `trim` (at most (k - 1) // 2) dropped from each end, the
    rest's exact sum (math.fsum) ÷ their count, rounded to float32."""
    k = rows.shape[0]
    t = min(trim, (k - 1) // 2)
    return np.array([math.fsum(sorted(col.tolist())[t:k - t]) / (k - 2 * t)
                     for col in rows.T], np.float32)


def _grid(rng, k: int, n: int) -> np.ndarray:
    """Random float32 values on a grid (ties included) whose float64 sums are exact."""
    return (rng.integers(-40, 40, (k, n)) * 0.125
            + rng.integers(-2 ** 20, 2 ** 20, (k, n)) * 2.0 ** -24).astype(np.float32)


@pytest.mark.parametrize("trim", [1, 2])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 7])
def test_the_trimmed_mean_is_numpy_s_column_by_column(k, trim):
    rng = np.random.default_rng(k * 10 + trim)
    rows = _grid(rng, k, 513)
    out = np.empty(rows.shape[1], np.float32)
    strategy.TrimmedMean(trim).reduce(rows.copy(), out)
    assert np.array_equal(out, _reference(rows, trim))
    if k <= 2 * trim:  # the coordinate median
        assert np.array_equal(out, np.median(rows.astype(np.float64), axis=0).astype(np.float32))


@pytest.mark.parametrize("encoding", ["f32", "bf16", "q4"])
def test_the_accumulator_reduces_the_kept_pushes_chunk_by_chunk(encoding):
    """Over several chunks (and a last partial q4 block), pushes as decoded."""
    n = 2 * CHUNK + 100
    rng = np.random.default_rng(1)
    deltas = _grid(rng, 5, n)
    acc = MergeAccumulator(n, "trimmed")
    assert acc.keeps_pushes  # whatever the number of islands
    for i, d in enumerate(deltas):
        acc.add(codec.encode(d, encoding), encoding, loss_tokens=10 ** i, learner=f"i{i}")
    decoded = np.stack([codec.decode(codec.encode(d, encoding), encoding, n) for d in deltas])
    got = acc.result()
    assert np.array_equal(got, _reference(decoded, 1)) and not acc.deferred


def test_one_island_is_one_row_and_the_norm_bound_still_applies():
    """An island's pushes of a round are averaged into one value per coordinate (more
    pushes buy no more rows); a push over its norm bound is scaled to it first."""
    n = 64
    a, b, c = np.full(n, 1.0, np.float32), np.full(n, 2.0, np.float32), np.full(n, 3.0,
                                                                                 np.float32)
    acc = MergeAccumulator(n, strategy.TrimmedMean())
    for lid, d in (("a", a), ("b", b), ("b", 4 * b), ("c", c)):  # b: 2 and 8, mean 5
        acc.add(codec.encode(d, "f32"), "f32", 10, learner=lid)
    assert np.array_equal(acc.result(), np.full(n, 3.0, np.float32))  # median of 1, 3, 5
    acc = MergeAccumulator(n, "trimmed")
    acc.add(codec.encode(np.full(n, 100.0, np.float32), "f32"), "f32", 10,
            norm_limit=float(np.linalg.norm(np.full(n, 1.5))), learner="r")
    acc.add(codec.encode(a, "f32"), "f32", 10, learner="a")
    np.testing.assert_allclose(acc.result(), 1.25, rtol=1e-6)  # (1.5 + 1) / 2


def test_a_trimmed_run_keeps_pushes_before_any_round_opens():
    assert Run(Config(merge="trimmed")).rounds.keeps_pushes(0)
    assert not Run(Config()).rounds.keeps_pushes(0)
    assert "trimmed" in strategy.RULES and Config().merge == "mean"
