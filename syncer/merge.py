"""The round's merge: Σ wᵢΔᵢ accumulated as pushes arrive, then one outer step.
Pure numpy; memory per round is one accumulator, whatever the number of islands. The
merge rule and the outer optimizer are strategy objects (`syncer.strategy`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from syncer import strategy
from syncer.bounds import CENTER_MIN_ISLANDS, center_scales, share_factors
from syncer.staging import Pushed, StagedSum
from yeto import codec
from yeto.codec import buffers, chunked, kernels
from yeto.codec import format as fmt

# values per outer-step call: one compiled pass each (cache-sized chunks buy nothing to a
# single pass), and one release of the GIL each (BENCHMARKS.md, "The step behind the
# broadcast")
STEP_PIECE = 1 << 23

MERGE_RULES = tuple(strategy.RULES)


@dataclass(frozen=True)
class DeferredPush:
    """A push kept as received (compressed) until its round commits: clipping needs
    the round's median norm, and the share cap every island's weight, known only then."""

    payload: chunked.AnyPayload  # the wire bytes (q4: 0.5625 B/param)
    encoding: str
    weight: float
    norm: float
    bound_scale: float = 1.0  # the norm bound's scale (syncer.bounds), before clipping
    learner: str = ""  # whose push: the share cap adds up each island's pushes


class Added(NamedTuple):
    """One push as `MergeAccumulator.add` summed it."""

    weight: float  # its rule weight
    norm: float    # its norm as received
    scale: float   # the norm bound's scale (1: within the bound)


class NonFinite(ArithmeticError):
    """The outer step produced a non-finite value (the bounds on pushes exclude it)."""


class MergeAccumulator:
    """Accumulates Σ wᵢΔᵢ as pushes arrive, wᵢ as the merge rule weighs them (`rule`:
    a `syncer.strategy` rule or its name); at the commit, g = Σ wᵢΔᵢ / Σ wᵢ times the
    rule's factor, if it has one.

    Zero loss tokens: under mean and rda a push with 0 loss tokens gets weight 0,
    unless every push of the round has 0: then the round falls back to uniform
    weights (the islands did work; their tokens simply were not counted). Memory
    stays one buffer: until a push with tokens arrives, zero-token pushes are summed
    with weight 1, and the first push with tokens clears them.
    """

    def __init__(self, numel: int, rule: strategy.Mean | str = "mean", clip_factor: float = 0.0,
                 max_abs: float | None = None,
                 share_cap: Callable[[int], float] | None = None, center_factor: float = 0.0):
        self.rule = strategy.merge_rule(rule) if isinstance(rule, str) else rule
        self.numel, self.clip_factor = numel, float(clip_factor)
        # the most of the merge one island may hold, given how many pushed (None: no cap)
        self.share_cap = share_cap
        self.center_factor = float(center_factor)  # the centre bound (syncer.bounds)
        # pushes are kept from now on (`expect`); a reducing rule keeps them all
        self.keeping = self.clip_factor > 0 or self.rule.keeps_pushes
        # (learner, rule weight) of each push summed as it came (not kept)
        self.summed_weights: list[tuple[str, float]] = []
        self.max_abs = max_abs  # the value bound every push meets (syncer.bounds)
        self.sum: np.ndarray | None = None
        self.fresh = True  # nothing summed yet, whatever sum's bytes: the next push writes
        self.total_weight = 0.0  # Σ wᵢ under the rule (0 while no push carried tokens)
        self.norm_sum = 0.0
        self.count = 0
        self.deferred: list[DeferredPush] = []  # only when it `keeps_pushes`
        self.clip_scales: list[float] = []
        self.share_scales: dict[str, float] = {}  # islands whose weight the cap lowered
        self.center_scales: dict[str, float] = {}  # islands the centre bound pulled in
        self.center_ratios: dict[str, float] = {}  # each one's distance ÷ the others'
        self.staging: StagedSum | None = None  # a push summed as it arrives (syncer.staging)

    @property
    def keeps_pushes(self) -> bool:
        """Pushes are kept as received until the commit (clipping, a rule that reduces
        them, or a share cap that may bind: `expect`)."""
        return self.keeping

    def expect(self, islands: int) -> None:
        """`islands` islands may push to this round: if the share cap or the centre bound
        can bind for that many, every push from now on is kept until the commit (those
        already summed keep their weight)."""
        if self.share_cap is not None and self.share_cap(islands) < 1.0:
            self.keeping = True
        if self.center_factor > 0 and islands >= CENTER_MIN_ISLANDS:
            self.keeping = True

    def weight_for(self, loss_tokens: int) -> float:
        return self.rule.weight(loss_tokens)

    @property
    def uniform_fallback(self) -> bool:
        """Every push so far carried 0 loss tokens: the round merges them uniformly."""
        return self.count > 0 and self.total_weight <= 0

    def merged_weight(self, weight: float) -> float:
        """The weight a push with rule weight `weight` really gets in the merge."""
        return 1.0 if self.uniform_fallback else weight

    def add(self, payload: Pushed, encoding: str, loss_tokens: int,
            norm_limit: float | None = None, learner: str = "") -> Added:
        """Decode and add one push, one chunk at a time (no decoded copy of the push),
        scaled down to norm `norm_limit` when it is longer (the norm bound); returns
        (rule weight, its norm as received, the scale it was summed with). Validates
        first, so a bad payload raises CodecError and leaves the accumulator untouched."""
        w = self.weight_for(loss_tokens)
        if isinstance(payload, StagedSum) and payload.demoted:  # summed whole after all
            payload = payload.payload()
        if not isinstance(payload, (buffers.SpilledPayload, StagedSum)):  # checked as written
            codec.validate(payload, encoding, self.numel, self.max_abs)
        if isinstance(payload, StagedSum):  # summed as it arrived: folded in now
            norm, scale = self._fold(payload, w, norm_limit)
            self.summed_weights.append((learner, w))
        elif self.keeps_pushes:  # kept as received (compressed) until the round commits
            norm = chunked.norm(payload, encoding, self.numel)
            scale = _bound_scale(norm, norm_limit)
            self.deferred.append(DeferredPush(payload, encoding, w, norm, scale, learner))
            self.total_weight += w
        else:
            norm, scale = self._accumulate(payload, encoding, w, norm_limit)
            self.summed_weights.append((learner, w))
        self.count += 1
        return Added(w, norm, scale)

    def _accumulate(self, payload: chunked.AnyPayload, encoding: str, w: float,
                    norm_limit: float | None) -> tuple[float, float]:
        """Sum one push (its norm computed in the same pass); a push over `norm_limit`
        is then topped up with (scale − 1) × itself: one more pass, for it alone."""
        weight = self._buffer_weight(w)
        buf = self._buffer() if weight else None
        norm = chunked.decode_add_norm(payload, encoding, self.numel, buf, weight,
                                       assign=self.fresh)
        scale = _bound_scale(norm, norm_limit)
        if buf is not None:
            if scale < 1.0:
                chunked.decode_add(payload, encoding, self.numel, buf, weight * (scale - 1.0))
            self.norm_sum += weight * scale * norm
            self.fresh = False
        return norm, scale

    def _fold(self, staged: StagedSum, w: float, norm_limit: float | None) -> tuple[float, float]:
        """A push staged into this round's fresh sum (`syncer.staging`) becomes its
        first summand: the weight it was summed with is `w`."""
        if staged.acc is not self or self.staging is not staged or not self.fresh or self.count:
            raise codec.CodecError("a staged push can only be folded into the round it "
                                   "was staged into, first")
        weight = self._buffer_weight(w)
        norm, scale = staged.fold(norm_limit)
        self.norm_sum += weight * scale * norm
        self.fresh, self.staging = False, None
        return norm, scale

    def stage(self, staged: StagedSum) -> None:
        """`staged` decodes into this round's fresh sum as it arrives (`syncer.staging`)."""
        self.staging = staged

    def unstage(self, demote: bool = False) -> None:
        """No push stages into the sum any more; `demote`: the one that did goes on as a
        whole push."""
        if demote and self.staging is not None:
            self.staging.demote()
        self.staging = None

    def staging_buffer(self) -> np.ndarray:
        """The sum buffer a push stages into (it stays fresh until folded)."""
        buf = self._buffer()
        self.fresh = True
        return buf

    def _buffer_weight(self, w: float) -> float:
        """The weight a validated push is summed with now (see the class docstring)."""
        if w > 0:
            if self.uniform_fallback:  # the first push with tokens: drop the 0-token ones
                self.fresh = True
                self.norm_sum = 0.0
            self.total_weight += w
            return w
        return 1.0 if self.total_weight <= 0 else 0.0

    def _buffer(self) -> np.ndarray:
        if self.sum is None:
            self.sum = np.empty(self.numel, dtype=np.float32)
            self.fresh = True
        return self.sum

    def reuse(self, buf: np.ndarray) -> None:
        """Sum into `buf` (a last round's scratch): no new fragment-sized allocation, and
        no pass to zero it (the first push writes instead of adding)."""
        self.sum, self.fresh = buf, True

    def summed(self) -> np.ndarray | None:
        """The running sum Σ wᵢΔᵢ, None while no push has been summed."""
        return None if self.fresh else self.sum

    def result(self) -> np.ndarray:
        """The merged pseudo-gradient g (reuses the accumulator's buffer)."""
        divisor, g = self._prepare(), self._buffer()
        g /= divisor
        if self.rule.rescales:
            factor = self.rule.factor(chunked.vector_norm(g), self.norm_sum / divisor)
            if factor is not None:
                g *= factor
        return g

    def step_outer(self, outer: strategy.Nesterov, theta: np.ndarray, m: np.ndarray | None,
                   t: int = 1, on_chunk: Callable[[int, int], None] | None = None
                   ) -> np.ndarray:
        """`outer.step(theta, m, self.result(), t)` with the same bits, in one pass over
        the buffers (four when the rule rescales: g divided, its norm, the factor, the step),
        on a few threads, in pieces of STEP_PIECE values: one compiled call each, so the
        step releases the GIL once per piece and keeps its speed beside the threads that
        send (`syncer.stepping`). Returns the sum's buffer (scratch afterwards: `reuse`
        it). Raises NonFinite if Θ or m came out non-finite. `on_chunk(lo, hi)` is
        called for each piece of Θ written and finite (from the thread that wrote it)."""
        divisor, g = self._prepare(), self._buffer()
        outer.begin(g, m, t)  # the whole round, for rules that look at it (g up to 1/divisor)
        if self.rule.rescales:
            def by_divisor(lo: int, hi: int) -> None:
                g[lo:hi] /= divisor

            chunked.each_chunk(g.size, by_divisor)
            factor = self.rule.factor(chunked.vector_norm(g), self.norm_sum / divisor)
            divisor = 1.0
            if factor is not None:
                def by_factor(lo: int, hi: int) -> None:
                    g[lo:hi] *= factor

                chunked.each_chunk(g.size, by_factor)

        def one(lo: int, hi: int) -> bool:
            # its finiteness checked in the same pass: the guard behind syncer.bounds
            ok = outer.step(theta[lo:hi], None if m is None else m[lo:hi], g[lo:hi], t,
                            divisor)
            if ok and on_chunk is not None:
                on_chunk(lo, hi)
            return ok

        if not all(chunked.each_chunk(g.size, one, size=STEP_PIECE)):
            raise NonFinite("the outer step made Θ or the momentum non-finite")
        return g

    def _prepare(self) -> float:
        """Merge deferred (clipped) pushes; the divisor of the round's sum."""
        if self.count == 0:
            raise RuntimeError("no pushes to merge")
        if self.deferred and self.rule.keeps_pushes:
            return self._merge_reduced()
        if self.deferred:
            return self._merge_deferred()
        return self.count if self.uniform_fallback else self.total_weight

    def _clip_limit(self) -> float:
        """The norm every kept push is scaled to at most: clip_factor × the round's
        median norm (0: no clipping)."""
        return (self.clip_factor * float(np.median([p.norm for p in self.deferred]))
                if self.clip_factor > 0 else 0.0)

    def _merge_reduced(self) -> float:
        """The rule's coordinate-wise reduction (`strategy.TrimmedMean.reduce`) of the
        kept pushes into the sum's buffer, one chunk of values at a time: each island's
        row of the chunk (its pushes within the norm bound and clipping, averaged),
        stacked k × chunk and reduced. No push is decoded whole. Returns 1 (the buffer
        holds g)."""
        if self.summed_weights:
            raise RuntimeError("a reducing rule merges kept pushes only")
        limit = self._clip_limit()
        islands: dict[str, list[tuple[DeferredPush, float]]] = {}
        for p in self.deferred:
            scale = min(1.0, limit / p.norm) if limit and p.norm > 0 else 1.0
            if self.clip_factor > 0:
                self.clip_scales.append(scale)
            islands.setdefault(p.learner, []).append((p, scale * p.bound_scale))
        rows_of = [[(p, w / len(ps)) for p, w in ps] for ps in islands.values()]
        buf = self._buffer()

        def one(lo: int, hi: int) -> None:
            self.rule.reduce(island_rows(rows_of, self.numel, lo, hi), buf[lo:hi])

        chunked.each_chunk(self.numel, one)
        self.fresh, self.norm_sum = False, 0.0
        self.deferred.clear()
        return 1.0

    def _merge_deferred(self) -> float:
        """Merge the kept pushes into the sum of those summed as they came: each
        island's weight within the share cap, each push scaled to norm ≤ clip_factor ×
        the round's median norm (with clipping on), then each island within the centre
        bound (`Centre`). Returns the round's divisor (Σ of the weights as merged)."""
        limit = self._clip_limit()
        factors = self._share_factors()
        summed = [self.merged_weight(w) for _, w in self.summed_weights]
        if not any(summed):  # nothing summed, or only 0-token pushes a weighted push drops
            self.fresh, self.norm_sum = True, 0.0
        buf, divisor = self._buffer(), float(sum(summed))
        kept: list[tuple[DeferredPush, float]] = []  # each push, the weight it is summed with
        for p in self.deferred:
            scale = min(1.0, limit / p.norm) if limit and p.norm > 0 else 1.0
            weight = self.merged_weight(p.weight) * factors[p.learner]
            w = weight * scale * p.bound_scale
            divisor += weight
            if self.clip_factor > 0:
                self.clip_scales.append(scale)
            self.norm_sum += w * p.norm
            kept.append((p, w))
        centre = Centre.of(kept, self.numel, self.center_factor)
        first = self.fresh  # the first kept push writes the buffer instead of adding

        def one(lo: int, hi: int) -> np.ndarray | None:
            """Σ w·Δ over [lo, hi), push after push (the bits of decoding each whole
            push in turn), and, with a centre, each island's squared distance there."""
            for j, (p, w) in enumerate(kept):
                piece = chunked.chunk_payload(p.payload, p.encoding, self.numel, lo, hi)
                fmt.decode_add(piece, p.encoding, hi - lo, buf[lo:hi], w, assign=first and j == 0)
            return None if centre is None else centre.squares(lo, hi)

        parts = chunked.each_chunk(self.numel, one)
        self.fresh = self.fresh and not kept
        if centre is not None:
            centre.pull(buf, [x for x in parts if x is not None])
            self.center_scales, self.center_ratios = centre.scales, centre.ratios
        self.deferred.clear()
        return divisor

    def _share_factors(self) -> dict[str, float]:
        """Each island's factor on its kept pushes under the share cap (1 without one):
        its whole weight (summed and kept) brought to the cap where it is over, by
        lowering its kept part (a part already summed keeps its weight)."""
        fixed: dict[str, float] = {}
        kept: dict[str, float] = {}
        for lid, w in self.summed_weights:
            fixed[lid] = fixed.get(lid, 0.0) + self.merged_weight(w)
        for p in self.deferred:
            kept[p.learner] = kept.get(p.learner, 0.0) + self.merged_weight(p.weight)
        if self.share_cap is None:
            return dict.fromkeys(kept, 1.0)
        total = {i: fixed.get(i, 0.0) + kept.get(i, 0.0) for i in fixed.keys() | kept.keys()}
        want = share_factors(total, self.share_cap(len(total)))
        out: dict[str, float] = {}
        for i, q in kept.items():
            s = fixed.get(i, 0.0)
            out[i] = max(0.0, (want[i] * total[i] - s) / q) if q > 0 else 1.0
            if out[i] < 1.0:
                self.share_scales[i] = (s + out[i] * q) / total[i]
        return out


def island_rows(islands: list[list[tuple[DeferredPush, float]]], numel: int, lo: int,
                hi: int) -> np.ndarray:
    """Values [lo, hi) of one row per island (k × (hi − lo) float32): each island's kept
    pushes decoded one chunk at a time and summed with their weights."""
    rows = np.empty((len(islands), hi - lo), np.float32)
    for row, pushes in zip(rows, islands):
        for j, (p, w) in enumerate(pushes):
            piece = chunked.chunk_payload(p.payload, p.encoding, numel, lo, hi)
            fmt.decode_add(piece, p.encoding, hi - lo, row, w, assign=j == 0)
    return rows


def _bound_scale(norm: float, limit: float | None) -> float:
    """The factor that brings a push of `norm` within `limit` (1: within already)."""
    return limit / norm if limit is not None and norm > limit else 1.0


class Centre:
    """The centre bound (syncer.bounds, "The centre") on a round's kept pushes. Island
    i's row rᵢ is its pushes' weighted mean (weights as summed, Wᵢ in all), so the sum
    holds Σ Wᵢrᵢ; with c the rows' coordinate-wise median, `squares` gives each
    island's ‖rᵢ − c‖² one chunk at a time (in the merge's own pass), and `pull`, only
    where an island is over (`center_scales`), adds Wᵢ(sᵢ − 1)(rᵢ − c) to the sum in a
    second pass: it then holds Wᵢ(c + sᵢ(rᵢ − c)) for that island. Islands merged at
    weight 0 take no part in the median."""

    def __init__(self, rows: dict[str, list[tuple[DeferredPush, float]]], numel: int,
                 factor: float):
        self.rows, self.numel, self.factor = rows, numel, factor
        self.ids = list(rows)
        self.totals = [sum(w for _, w in rows[lid]) for lid in self.ids]
        # each island's pushes weighted to their mean: its row rᵢ (`island_rows`)
        self.means = [[(p, w / total) for p, w in rows[lid]]
                      for lid, total in zip(self.ids, self.totals)]
        self.scales: dict[str, float] = {}  # islands pulled in: sᵢ < 1
        self.ratios: dict[str, float] = {}  # each island's distance ÷ its others'

    @classmethod
    def of(cls, kept: list[tuple[DeferredPush, float]], numel: int, factor: float
           ) -> Centre | None:
        """The bound over `kept` (pushes with their summed weights), None where it does
        not apply (factor 0, fewer than CENTER_MIN_ISLANDS islands with weight)."""
        rows: dict[str, list[tuple[DeferredPush, float]]] = {}
        for p, w in kept:
            rows.setdefault(p.learner, []).append((p, w))
        rows = {lid: ps for lid, ps in rows.items() if sum(w for _, w in ps) > 0}
        if factor <= 0 or len(rows) < CENTER_MIN_ISLANDS:
            return None
        return cls(rows, numel, factor)

    def off_center(self, lo: int, hi: int) -> np.ndarray:
        """rᵢ − c over [lo, hi), one island per row."""
        x = island_rows(self.means, self.numel, lo, hi)
        x -= kernels.column_median(x)
        return x

    def squares(self, lo: int, hi: int) -> np.ndarray:
        """Each island's ‖rᵢ − c‖² over [lo, hi) (float32 per chunk, summed in float64)."""
        x = self.off_center(lo, hi)
        out: np.ndarray = np.einsum("ij,ij->i", x, x).astype(np.float64)
        return out

    def pull(self, buf: np.ndarray, squares: list[np.ndarray]) -> None:
        """From the chunks' `squares`, each island's scale; the islands over it pulled in
        (a second pass over the pushes, only then)."""
        distances = np.sqrt(np.sum(squares, axis=0))
        scales, self.ratios = center_scales(dict(zip(self.ids, distances.tolist())),
                                            self.factor)
        self.scales = {lid: s for lid, s in scales.items() if s < 1.0}
        if not self.scales:
            return
        coef = np.array([t * (scales[lid] - 1.0) for lid, t in zip(self.ids, self.totals)],
                        np.float32)

        def one(lo: int, hi: int) -> None:
            buf[lo:hi] += coef @ self.off_center(lo, hi)

        chunked.each_chunk(self.numel, one)
