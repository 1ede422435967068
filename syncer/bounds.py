"""What one island can do to the shared model: the bounds every push and join meets.

The trust model (README, Faults): an island holding a valid credential may push bad
but plausible data; it may not make Θ non-finite, move it by more than the norm bound,
or claim more tokens than it can have trained. The bounds, each checked where the
value enters, before it touches the round:

- **Values** (`max_delta`): every element of a push decodes to |x| ≤ max_delta (q4:
  every block scale ≤ max_delta / 7), and the seed to |x| ≤ `SEED_MAX_ABS`. With
  merge weights bounded too (below), the round's sum stays below 1e30 however many
  islands push, so it cannot overflow float32 (3.4e38): Θ stays finite by
  construction, and the commit checks it again.
- **Norms** (`norm_factor`, `NormBounds`): a push whose norm exceeds norm_factor × the
  other islands' typical norm on its fragment (before any other island has pushed:
  × the seed's norm of the fragment) is scaled down to that bound before it is summed
  (its weight is kept). An island's own pushes never raise its own bound. One round's
  merged change is a weighted mean of bounded pushes, so its norm is at most the
  largest bound too (add `--clip-factor` for a bound relative to each round's median).
- **Claims**: loss tokens ≤ steps × the tokens per step the island declared at its
  first join (batch × sequence length; at most `max_tokens_per_step`, which is also
  the bound of an island that declares none); steps ≤ its declared schedule (H steps
  between pushes, declared at its first join) × (2 + the fragment's commits it missed
  since its last accepted push: carried work), and ≤ `max_steps_per_push` always. A
  rejoin keeps the first declarations: an island cannot raise them mid-run. With
  `max_steps_per_second` R (the fleet's top speed, as the operator knows it), steps ≤
  R × the seconds since the island's last accepted push to that fragment (or since
  this syncer enrolled it), plus one second's steps and 2 × its H of slack: an island
  that declared no schedule (a time-based one), or one that stayed away for many
  rounds, cannot claim more steps than the wall time it had.
- **The centre** (`center_factor`, `center_scales`): in a round that k ≥ 3 islands
  pushed to, each island's push (its pushes of the round, weighted as merged, averaged)
  is measured by its distance from the round's coordinate-wise median; one farther than
  center_factor × the lower median of the *other* islands' distances is pulled toward
  the median to that distance before it is summed (its weight kept). The norm bound
  follows the honest islands' norms, which grow as a rogue drags Θ from their optimum;
  their distances from their own median do not (they measure how much honest islands
  disagree), so a minority rogue's pull per round stays bounded however far it got.
  Honest islands within the factor are merged bit for bit as without it.
- **Shares** (`max_share`): no island's share of a round's merge exceeds the cap
  (`share_cap`: by default 2/k for k islands in the round, so none for k ≤ 2); an
  island over it keeps its direction with its weight lowered (`share_factors`). The
  cap needs the pushes until the commit: from the moment a third island may push to a
  round (live, or pushed), the round keeps its pushes as received (as clipping does);
  those summed before keep their weight.
- **Layouts**: the first island's layout sets the run's, so it must be sane: every
  dimension ≥ 1, a float dtype, at most `max_params` values in all.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from yeto.codec import chunked
from yeto.layout import TensorSpec
from yeto.transport import CARRY_SLACK, OVER_SCHEDULE

SEED_MAX_ABS = 1e8    # initial weights: far beyond any model's, far below overflow
HISTORY = 8           # push norms per island and fragment the norm bound looks back on
DTYPES = ("float32", "float16", "bfloat16", "float64")


class BoundError(ValueError):
    """A value outside its bound; the message names the bound and its flag."""


@dataclass(frozen=True)
class Bounds:
    max_delta: float = 1e3
    norm_factor: float = 10.0
    max_tokens_per_step: int = 1 << 20
    max_steps_per_push: int = 100_000
    max_params: int = 1 << 32
    max_share: float = 0.0  # 0: auto (2/k for k islands in a round)
    max_steps_per_second: float = 0.0  # 0: no wall-time bound on claimed steps
    center_factor: float = 3.0  # 0: off (BENCHMARKS.md, "Trust, round two")

    def check(self) -> None:
        for name in ("max_delta", "max_tokens_per_step", "max_steps_per_push", "max_params"):
            v = getattr(self, name)
            if not (np.isfinite(v) and v > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number, "
                                 f"got {v}")
        if not (np.isfinite(self.norm_factor) and self.norm_factor >= 0):
            raise ValueError(f"--norm-factor must be >= 0 (0 = off), got {self.norm_factor}")
        if not (np.isfinite(self.center_factor) and self.center_factor >= 0):
            raise ValueError(f"--center-factor must be >= 0 (0 = off), got {self.center_factor}")
        if not (np.isfinite(self.max_steps_per_second) and self.max_steps_per_second >= 0):
            raise ValueError("--max-steps-per-second must be >= 0 (0 = no wall-time bound), "
                             f"got {self.max_steps_per_second}")
        if not 0 <= self.max_share <= 1:
            raise ValueError(f"--max-share must be in [0, 1] (0 = auto: 2/k), got "
                             f"{self.max_share}")

    def share_cap(self, islands: int) -> float:
        """The most of a round's merge one island may hold when `islands` push to it
        (1: no cap). Never below 1/islands, which equal shares meet."""
        cap = self.max_share or 2.0 / max(islands, 1)
        return min(1.0, max(cap, 1.0 / max(islands, 1)))


    def claims(self, loss_tokens: int, steps: int, tokens_per_step: int,
               sync_every: int = 0, missed: int = 0, trained_s: float = math.inf) -> None:
        """Raise BoundError unless a push's claimed tokens and steps are plausible: an
        island that declared `sync_every` H steps between pushes, and missed `missed`
        commits of the fragment since its last accepted push, carries at most
        H × (CARRY_SLACK + missed) steps; with `max_steps_per_second`, at most that many
        per second of `trained_s` (the wall time since its last accepted push there)."""
        if steps > self.max_steps_per_push:
            raise BoundError(f"push claims {steps} steps; a push may carry at most "
                             f"{self.max_steps_per_push} (--max-steps-per-push)")
        if sync_every and steps > sync_every * (CARRY_SLACK + missed):
            raise BoundError(f"push claims {steps} steps, {OVER_SCHEDULE}: the island "
                             f"declared a push every {sync_every} steps when it joined and "
                             f"missed {missed} commits since its last accepted push, so it "
                             f"can carry at most {sync_every * (CARRY_SLACK + missed)}")
        rate = self.max_steps_per_second
        if rate and steps > (most := self.steps_in(trained_s, sync_every)):
            # (OVER_SCHEDULE: an island that declared H then cuts the claim it carries)
            raise BoundError(f"push claims {steps} steps, {OVER_SCHEDULE} at {rate:g} steps "
                             f"per second (--max-steps-per-second): {trained_s:.1f} s since "
                             f"its last accepted push (or its join) allow at most {most}")
        per_step = min(tokens_per_step or self.max_tokens_per_step, self.max_tokens_per_step)
        if loss_tokens > steps * per_step:
            raise BoundError(f"push claims {loss_tokens} loss tokens in {steps} steps: more "
                             f"than {per_step} per step, what the island declared when it "
                             "joined (--max-tokens-per-step caps any declaration)")

    def steps_in(self, seconds: float, sync_every: int = 0) -> int:
        """The most steps an island may claim after `seconds` of training at
        `max_steps_per_second` (one second's more, and CARRY_SLACK × its H)."""
        if not math.isfinite(seconds):
            return self.max_steps_per_push
        return math.ceil(self.max_steps_per_second * (seconds + 1.0)) + CARRY_SLACK * sync_every

    def declaration(self, tokens_per_step: int) -> int:
        if tokens_per_step > self.max_tokens_per_step:
            raise BoundError(f"declares {tokens_per_step} tokens per step; this run allows "
                             f"at most {self.max_tokens_per_step} (raise the syncer's "
                             "--max-tokens-per-step if a step really holds more)")
        return tokens_per_step

    def layout(self, specs: Iterable[TensorSpec]) -> None:
        """Raise BoundError unless a layout could be a real model's."""
        total = 0
        for s in specs:
            if not s.shape or any(d < 1 or d > self.max_params for d in s.shape):
                raise BoundError(f"tensor {s.name} has shape {tuple(s.shape)}: every "
                                 f"dimension must be 1 to {self.max_params} (--max-params)")
            if s.dtype not in DTYPES:
                raise BoundError(f"tensor {s.name} has dtype {s.dtype!r}; use one of "
                                 f"{', '.join(DTYPES)}")
            total += s.numel
            if total > self.max_params:
                raise BoundError(f"the layout holds more than {self.max_params} values; "
                                 "raise the syncer's --max-params if the model is that big")


class NormBounds:
    """The norm bound of every fragment (syncer.bounds, "Norms"): each island's recent push
    norms as received (before any scaling), and each fragment's ceiling from the seed.

    The bound a push of island i meets is `factor` × the lower median of the other
    islands' medians (their last `HISTORY` pushes): i's own pushes never raise its own
    limit, and with an even count the lower middle value is taken, so a minority cannot
    raise anyone's limit either. Before any other island has pushed to the fragment
    (round 1, or a run of one island) the bound is `factor` × the fragment's ceiling:
    the seed's norm of that fragment, or, where the seed holds zeros there (LoRA B),
    the seed's root mean square × √(fragment size)."""

    def __init__(self, factor: float):
        self.factor = float(factor)
        self._norms: dict[int, dict[str, collections.deque[float]]] = {}
        self._ceiling: dict[int, float] = {}

    def seed(self, theta: np.ndarray, spans: list[tuple[int, int]]) -> None:
        """Each fragment's ceiling from Θ as seeded (or as resumed from an older state)."""
        norms = [chunked.vector_norm(theta[lo:hi]) for lo, hi in spans]  # no copy of Θ
        rms = float(np.sqrt(sum(x * x for x in norms) / theta.size)) if theta.size else 0.0
        for f, ((lo, hi), own) in enumerate(zip(spans, norms)):
            self._ceiling[f] = own if own > 0 else rms * float(np.sqrt(hi - lo))

    def limit(self, fragment: int, learner: str) -> float | None:
        """The norm `learner`'s push to `fragment` may have now (None: the bound is off,
        or nothing to measure it by: an all-zero seed and no other island's push)."""
        if self.factor <= 0:
            return None
        others = [float(np.median(h)) for lid, h in self._norms.get(fragment, {}).items()
                  if lid != learner and h]
        if others:
            others.sort()
            typical = others[(len(others) - 1) // 2]  # the lower median
        else:
            typical = self._ceiling.get(fragment, 0.0)
        return self.factor * typical if typical > 0 else None

    def observe(self, fragment: int, learner: str, norm: float) -> None:
        """A push's norm as received (before its bound scaled it)."""
        if np.isfinite(norm) and norm >= 0:
            self._norms.setdefault(fragment, {}).setdefault(
                learner, collections.deque(maxlen=HISTORY)).append(float(norm))

    def saved(self) -> dict[str, Any]:
        """What the state file keeps (`restore` reads it back)."""
        return dict(ceiling={str(f): c for f, c in self._ceiling.items()},
                    islands={str(f): {lid: list(h) for lid, h in by.items()}
                             for f, by in self._norms.items()})

    def restore(self, saved: Any) -> None:
        """From `saved()`'s dict; an older state's list per fragment (no island ids)
        counts as one anonymous island's history."""
        if not isinstance(saved, dict) or "islands" not in saved:
            saved = dict(ceiling={}, islands={f: {"": n} for f, n in (saved or {}).items()})
        self._ceiling = {int(f): float(c) for f, c in saved["ceiling"].items()
                         if np.isfinite(c) and c >= 0}
        self._norms = {}
        for f, by in saved["islands"].items():
            for lid, norms in by.items():
                for x in norms:
                    self.observe(int(f), lid, x)

    def has_ceiling(self) -> bool:
        return bool(self._ceiling)


CENTER_MIN_ISLANDS = 3  # a median of fewer is no centre: one of two islands is half of it


def center_scales(distances: dict[str, float], factor: float
                  ) -> tuple[dict[str, float], dict[str, float]]:
    """("Centre" above) Per island, the factor on its distance from the round's median
    that brings it to at most `factor` × the lower median of the other islands'
    distances (1 within it), and its ratio to that lower median (what the tape keeps:
    the margin an honest fleet had). No bound (all 1) for fewer than
    CENTER_MIN_ISLANDS islands, with `factor` 0, or for an island whose others' lower
    median is 0 (they agree exactly: nothing to measure a distance by)."""
    scales, ratios = dict.fromkeys(distances, 1.0), dict[str, float]()
    if factor <= 0 or len(distances) < CENTER_MIN_ISLANDS:
        return scales, ratios
    for lid, d in distances.items():
        others = sorted(x for other, x in distances.items() if other != lid)
        typical = others[(len(others) - 1) // 2]  # the lower median: a minority cannot raise it
        if typical > 0:  # (0: the others agree exactly, nothing to measure by)
            ratios[lid] = d / typical
            if d > factor * typical:
                scales[lid] = factor * typical / d
    return scales, ratios


def share_factors(weights: dict[str, float], cap: float) -> dict[str, float]:
    """Per island, the factor on its merge weight that brings its share of Σ weights to
    at most `cap` (1 for those within it): the largest islands are lowered to one common
    weight t, the rest keep theirs (water-filling). `cap` ≥ 1/len(weights)."""
    total = sum(weights.values())
    if cap >= 1.0 or total <= 0 or max(weights.values()) <= cap * total:
        return dict.fromkeys(weights, 1.0)
    ranked = sorted(weights, key=weights.__getitem__, reverse=True)
    for m in range(1, len(ranked)):
        rest = sum(weights[i] for i in ranked[m:])
        if cap * m >= 1.0:
            break
        t = cap * rest / (1.0 - cap * m)  # t = cap × (m·t + rest)
        if weights[ranked[m]] <= t:
            return {i: (t / weights[i] if k < m else 1.0) for k, i in enumerate(ranked)}
    return {i: (total / len(ranked)) / weights[i] if weights[i] > 0 else 1.0
            for i in ranked}  # cap = 1/k: equal weights
