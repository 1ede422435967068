"""The outer loop's strategy: a merge rule (how a round's pushes are weighed, and
whether their mean is rescaled) and an outer optimizer (how the merged change g
moves Θ). Both are small objects chosen by name (`--merge`, `--outer`), as Flower's
strategies and torchft's outer optimizer are; a new one is one class here, added to
`RULES` or `OPTIMIZERS`, tested without a server (tests/unit/test_strategy.py).

The syncer sums each push as it arrives (`syncer.merge.MergeAccumulator`), so a rule
sees a push's loss tokens when it arrives and the round's totals at the commit: the
weight of each push, then one optional factor on the weighted mean.
"""

from __future__ import annotations

import numpy as np


# ---- merge rules ------------------------------------------------------------------------
class Mean:
    """g = Σ wᵢΔᵢ / Σ wᵢ with wᵢ = the push's loss tokens."""

    name = "mean"
    rescales = False  # whether `factor` needs the mean's norm (a pass over g)

    def weight(self, loss_tokens: int) -> float:
        return float(max(loss_tokens, 0))

    def factor(self, mean_norm: float, typical_norm: float) -> float | None:
        """A factor on the weighted mean g (None: g as it is). `mean_norm` = ‖g‖,
        `typical_norm` = Σ wᵢ‖Δᵢ‖ / Σ wᵢ."""
        return None


class Uniform(Mean):
    """g = the plain mean of the pushes (wᵢ = 1)."""

    name = "uniform"

    def weight(self, loss_tokens: int) -> float:
        return 1.0


class RDA(Mean):
    """The token-weighted mean's direction, rescaled so that ‖g‖ = Σ wᵢ‖Δᵢ‖ / Σ wᵢ:
    averaging shrinks disagreeing updates; this keeps their typical size."""

    name = "rda"
    rescales = True

    def factor(self, mean_norm: float, typical_norm: float) -> float | None:
        return typical_norm / mean_norm if mean_norm > 0 else None


RULES = {r.name: r for r in (Mean, Uniform, RDA)}


def merge_rule(name: str) -> Mean:
    if name not in RULES:
        raise ValueError(f"unknown merge rule {name!r}; use one of {', '.join(RULES)}")
    return RULES[name]()


# ---- outer optimizers ---------------------------------------------------------------------
class Nesterov:
    """m ← μm + g;  Θ ← Θ − lr·(g + μm). lr 1 with μ 0 is plain averaging (the
    default: BENCHMARKS.md, "What the evidence says, and the defaults")."""

    name = "nesterov"

    def __init__(self, lr: float = 1.0, momentum: float = 0.0):
        self.lr, self.momentum = float(lr), float(momentum)

    @property
    def keeps_momentum(self) -> bool:
        """Whether the run keeps (and saves) a momentum buffer m."""
        return self.momentum != 0

    def step(self, theta: np.ndarray, m: np.ndarray | None, g: np.ndarray, t: int = 1) -> None:
        """One outer step, in place on theta and m; g is used as scratch (no full-size
        temporaries). `t`: this fragment's outer step count, from 1. With momentum 0,
        m is not needed (None): Θ ← Θ − lr·g."""
        if m is None or self.momentum == 0:
            if self.lr != 1.0:  # × 1 changes no bit: a pass over g saved (the default)
                g *= np.float32(self.lr)
            theta -= g
            return
        m *= np.float32(self.momentum)
        m += g
        g *= np.float32(self.lr)
        theta -= g
        np.multiply(m, np.float32(self.lr * self._momentum_weight(t)), out=g)
        theta -= g

    def _momentum_weight(self, t: int) -> float:
        return self.momentum


class BiasCorrectedNesterov(Nesterov):
    """Nesterov with the momentum term bias-corrected, as Adam corrects its first
    moment: Θ ← Θ − lr·(g + μ·m / (1 − μᵗ)). For a steady g, m = g·(1 − μᵗ)/(1 − μ)
    after t steps: the correction gives every round the step lr·g/(1 − μ) that plain
    Nesterov reaches only after many rounds, so an empty buffer no longer under-steps
    the first ones (issue 33's short runs)."""

    name = "nesterov-bc"

    def _momentum_weight(self, t: int) -> float:
        return self.momentum / (1.0 - self.momentum ** max(1, t))


OPTIMIZERS = {o.name: o for o in (Nesterov, BiasCorrectedNesterov)}


def outer_optimizer(name: str, lr: float, momentum: float) -> Nesterov:
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown outer optimizer {name!r}; use one of "
                         f"{', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name](lr, momentum)
