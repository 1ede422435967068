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
- **Norms** (`norm_factor`): a push whose norm exceeds norm_factor × the median norm
  of its fragment's last `HISTORY` accepted pushes (once `MIN_HISTORY` are known) is
  scaled down to that bound before it is summed (its weight is kept). One round's
  merged change is a weighted mean of bounded pushes, so its norm is at most the
  bound too. The first `MIN_HISTORY` pushes of a fragment meet the value bound only
  (add `--clip-factor` for a bound relative to each round's median).
- **Claims**: loss tokens ≤ steps × the tokens per step the island declared at its
  first join (batch × sequence length; at most `max_tokens_per_step`, which is also
  the bound of an island that declares none), and steps ≤ `max_steps_per_push`. A
  rejoin keeps the first declaration: an island cannot raise it mid-run.
- **Layouts**: the first island's layout sets the run's, so it must be sane: every
  dimension ≥ 1, a float dtype, at most `max_params` values in all.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np

SEED_MAX_ABS = 1e8    # initial weights: far beyond any model's, far below overflow
HISTORY = 32          # accepted push norms per fragment the norm bound looks back on
MIN_HISTORY = 4       # ... and how many it needs before it binds
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

    def check(self) -> None:
        for name in ("max_delta", "max_tokens_per_step", "max_steps_per_push", "max_params"):
            v = getattr(self, name)
            if not (np.isfinite(v) and v > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number, "
                                 f"got {v}")
        if not (np.isfinite(self.norm_factor) and self.norm_factor >= 0):
            raise ValueError(f"--norm-factor must be >= 0 (0 = off), got {self.norm_factor}")

    def claims(self, loss_tokens: int, steps: int, tokens_per_step: int) -> None:
        """Raise BoundError unless a push's claimed tokens and steps are plausible."""
        if steps > self.max_steps_per_push:
            raise BoundError(f"push claims {steps} steps; a push may carry at most "
                             f"{self.max_steps_per_push} (--max-steps-per-push)")
        per_step = min(tokens_per_step or self.max_tokens_per_step, self.max_tokens_per_step)
        if loss_tokens > steps * per_step:
            raise BoundError(f"push claims {loss_tokens} loss tokens in {steps} steps: more "
                             f"than {per_step} per step, what the island declared when it "
                             "joined (--max-tokens-per-step caps any declaration)")

    def declaration(self, tokens_per_step: int) -> int:
        if tokens_per_step > self.max_tokens_per_step:
            raise BoundError(f"declares {tokens_per_step} tokens per step; this run allows "
                             f"at most {self.max_tokens_per_step} (raise the syncer's "
                             "--max-tokens-per-step if a step really holds more)")
        return tokens_per_step

    def layout(self, specs) -> None:
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


class NormHistory:
    """A fragment's accepted push norms (after any scaling), newest `HISTORY`."""

    def __init__(self, norms=()):
        self._norms: collections.deque[float] = collections.deque(
            (float(x) for x in norms if np.isfinite(x) and x >= 0), maxlen=HISTORY)

    def values(self) -> list[float]:
        return list(self._norms)

    def limit(self, factor: float) -> float | None:
        """The norm a push may have now (None: no bound yet, or the bound is off)."""
        if factor <= 0 or len(self._norms) < MIN_HISTORY:
            return None
        median = float(np.median(self._norms))
        return factor * median if median > 0 else None

    def observe(self, norm: float) -> None:
        self._norms.append(float(norm))
