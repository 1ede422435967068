"""The outer loop's strategy: a merge rule (how a round's pushes are weighed, and
whether their mean is rescaled) and an outer optimizer (how the merged change g
moves Θ). Both are small objects chosen by name (`--merge`, `--outer`), as Flower's
strategies and torchft's outer optimizer are; a new one is one class here, added to
`RULES` or `OPTIMIZERS`, tested without a server (tests/unit/test_strategy.py).

The syncer sums each push as it arrives (`syncer.merge.MergeAccumulator`), so a rule
sees a push's loss tokens when it arrives and the round's totals at the commit: the
weight of each push, then one optional factor on the weighted mean. A robust rule
(`keeps_pushes`: `TrimmedMean`) has the round keep its pushes as received instead, and
reduces them coordinate by coordinate at the commit, one chunk of values at a time.
"""

from __future__ import annotations

import logging

import numpy as np

from yeto.codec import kernels

log = logging.getLogger("syncer")


# ---- merge rules ------------------------------------------------------------------------
class Mean:
    """g = Σ wᵢΔᵢ / Σ wᵢ with wᵢ = the push's loss tokens."""

    name = "mean"
    rescales = False  # whether `factor` needs the mean's norm (a pass over g)
    keeps_pushes = False  # whether the round keeps its pushes for `reduce` (not summed)

    def weight(self, loss_tokens: int) -> float:
        return float(max(loss_tokens, 0))

    def factor(self, mean_norm: float, typical_norm: float) -> float | None:
        """A factor on the weighted mean g (None: g as it is). `mean_norm` = ‖g‖,
        `typical_norm` = Σ wᵢ‖Δᵢ‖ / Σ wᵢ."""
        return None

    def reduce(self, rows: np.ndarray, out: np.ndarray) -> None:
        """What a rule that `keeps_pushes` defines: each chunk of the round's island rows
        (k × n float32) reduced into `out` at the commit (`TrimmedMean.reduce`)."""
        raise NotImplementedError(f"merge rule {self.name!r} keeps its pushes "
                                  "(keeps_pushes) but defines no reduce")


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


class TrimmedMean(Mean):
    """The coordinate-wise trimmed mean (Yin et al., "Byzantine-Robust Distributed
    Learning: Towards Optimal Statistical Rates", arXiv 1803.01498): per coordinate, the
    round's k island values (each island's pushes within the norm bound, averaged) are
    sorted, the `trim` lowest and `trim` highest dropped, and the rest averaged. One
    island's value is then dropped where it is extreme, and lies between honest values
    where it is kept: a rogue at its norm bound moves no coordinate past the honest
    islands' range. With k ≤ 2·trim it trims (k − 1) // 2 from each end: the
    coordinate median (k = 2: the mean of the two; k = 1: the push itself).

    Plain, not token-weighted: the tokens are each island's own claim, and a weight
    would let a rogue that sits at the edge of the honest range hold most of the
    coordinate's mean; plainly, an island holds at most 1/(k − 2·trim) of any coordinate
    (the share cap is not applied: the trim bounds every island). Its `weight` is 1 (the
    tape's shares are 1/k). The round keeps every push (`keeps_pushes`); the merge
    decodes one chunk of each at a time (`syncer.merge.MergeAccumulator`)."""

    name = "trimmed"
    keeps_pushes = True

    def __init__(self, trim: int = 1):
        self.trim = int(trim)

    def weight(self, loss_tokens: int) -> float:
        return 1.0

    def reduce(self, rows: np.ndarray, out: np.ndarray) -> None:
        """out = the trimmed mean of each column of `rows` (k × n float32, sorted in
        place): the kept values summed in float64 in sorted order, ÷ their count."""
        k = rows.shape[0]
        t = min(self.trim, (k - 1) // 2)
        kernels.sort_columns(rows)
        kept = rows[t:k - t]
        out[...] = np.add.reduce(kept, axis=0, dtype=np.float64) / kept.shape[0]


RULES = {r.name: r for r in (Mean, Uniform, RDA, TrimmedMean)}


def merge_rule(name: str) -> Mean:
    if name not in RULES:
        raise ValueError(f"unknown merge rule {name!r}; use one of {', '.join(RULES)}")
    return RULES[name]()


# ---- outer optimizers ---------------------------------------------------------------------
class Nesterov:
    """m ← μm + g;  Θ ← Θ − lr·(g + μm): DiLoCo's outer step (Douillard et al., "DiLoCo:
    Distributed Low-Communication Training of Language Models", arXiv 2311.08105). lr 1
    with μ 0 is plain averaging (`WarmupNesterov` warms up from it to lr 0.4, μ 0.9).
    SNOO (Kallusky et al., arXiv 2510.15830) is this same update on one
    worker's pseudo-gradient (k = 1), and Lookahead (Zhang et al., arXiv 1907.08610) is
    it with μ 0, lr = Lookahead's α: neither is a separate rule here.

    A subclass changes the step through `coefficients` (per round, from the fragment's
    outer step count t) and, where it needs to see the whole round, `begin`."""

    name = "nesterov"

    def __init__(self, lr: float = 1.0, momentum: float = 0.0):
        self.lr, self.momentum = float(lr), float(momentum)

    @property
    def keeps_momentum(self) -> bool:
        """Whether the run keeps (and saves) a momentum buffer m."""
        return self.momentum != 0

    def note_island(self, learner_id: str, regime: str) -> str | None:
        """An island that trains `regime` ("sft" or "rl") joined. A rule that follows the
        run's regime changes here and says how (a line for the log and the tape); the
        others ignore it (None)."""
        return None

    def begin(self, g: np.ndarray, m: np.ndarray | None, t: int) -> None:
        """Called once per round and fragment before `step` runs over its chunks, with the
        whole fragment's merged change (up to a positive factor) and momentum, before
        either changes. Nothing here; rules that look at the round override it. Any state
        it keeps must follow from (g, m, t): m and t are saved, so a resumed run steps
        the same."""

    def coefficients(self, t: int) -> tuple[float, float, float]:
        """(lr, μ, w) of round t: m ← μm + g; Θ ← Θ − lr·(g + w·m)."""
        return self.lr, self.momentum, self.momentum

    def step(self, theta: np.ndarray, m: np.ndarray | None, g: np.ndarray, t: int = 1,
             divisor: float = 1.0) -> bool:
        """One outer step with g / divisor (float32) as the round's change, in place on
        theta and m, in one pass (`yeto.codec.kernels`); g is used as scratch (no
        full-size temporaries). `t`: this fragment's outer step count, from 1. With
        momentum 0, m is not needed (None): Θ ← Θ − lr·g. Returns whether Θ and m came
        out finite."""
        if m is None or self.momentum == 0:
            return kernels.outer_step(theta, None, g, self.lr, 0.0, 0.0, divisor)
        return kernels.outer_step(theta, m, g, *self.coefficients(t), divisor)


class BiasCorrectedNesterov(Nesterov):
    """Nesterov with the momentum term bias-corrected, as Adam corrects its first
    moment (Kingma & Ba, "Adam: A Method for Stochastic Optimization", arXiv 1412.6980):
    Θ ← Θ − lr·(g + μ·m / (1 − μᵗ)). For a steady g, m = g·(1 − μᵗ)/(1 − μ) after t
    steps: the correction gives every round the step lr·g/(1 − μ) that plain Nesterov
    reaches only after many rounds, so an empty buffer does not under-step the first
    ones."""

    name = "nesterov-bc"

    def coefficients(self, t: int) -> tuple[float, float, float]:
        return self.lr, self.momentum, self.momentum / (1.0 - self.momentum ** max(1, t))


class WarmupNesterov(Nesterov):
    """Nesterov whose lr and μ warm up from plain averaging (lr 1, μ 0) to (lr, μ) over
    the first WARMUP rounds: with s = min(1, (t − 1)/WARMUP), lr_t = 1 + (lr − 1)·s and
    μ_t = μ·s. Round 1 is plain averaging, round WARMUP + 1 on is Nesterov (lr, μ).
    Sources: learning-rate warm-up (Goyal et al., "Accurate, Large Minibatch SGD",
    arXiv 1706.02677) and a momentum that grows over the first steps (Sutskever et
    al., "On the importance of initialization and momentum in deep learning", ICML
    2013, PMLR 28(3):1139, no arXiv version). Here the warm-up moves from the rule that
    wins short runs to the one that wins long ones (BENCHMARKS.md, "One outer rule for
    every regime")."""

    name = "nesterov-warmup"
    WARMUP = 20  # rounds

    def coefficients(self, t: int) -> tuple[float, float, float]:
        s = min(1.0, (max(1, t) - 1) / self.WARMUP)
        mu = self.momentum * s
        return 1.0 + (self.lr - 1.0) * s, mu, mu


class RegimeNesterov(WarmupNesterov):
    """The default (`--outer auto`): the outer rule follows what the run trains.

    - Supervised islands only (SFT, LoRA or full weights): `nesterov-warmup` with the
      given lr and μ (0.4/0.9): plain averaging at round 1, Nesterov 0.4/0.9 from round
      21: the one rule that met every SFT goal measured (short LoRA, warm k = 4 and 8,
      from scratch).
    - Once an island that trains with RL (a GRPO island, `yeto rl`) has joined: plain
      averaging (lr 1, μ 0) for every later round. A GRPO island pushes every few steps
      (2 in `yeto demo --rl`); Nesterov 0.4/0.9 steps about lr/(1 − μ) = 4× the merged
      change once its momentum has built up, and the demo's policy collapsed from round
      ~21, where plain averaging kept raising its reward.

    Both choices and the runs that chose them: BENCHMARKS.md, "One outer rule for every
    regime". The switch is made once, at the first RL join, and is taped
    (event `outer_rule`); a resumed run makes it again when its RL islands rejoin,
    before any push can commit. Name a rule (`--outer nesterov-warmup`, ...) to keep it
    whatever joins."""

    name = "auto"

    def __init__(self, lr: float = 1.0, momentum: float = 0.0):
        super().__init__(lr, momentum)
        self.rl = False  # an RL island has joined: plain averaging from now on

    def note_island(self, learner_id: str, regime: str) -> str | None:
        if regime != "rl" or self.rl:
            return None
        self.rl = True
        change = (f"{learner_id} trains with RL: the outer rule (auto) is plain averaging "
                  f"(lr 1, momentum 0) from now on, instead of nesterov-warmup "
                  f"{self.lr:g}/{self.momentum:g}")
        log.info("%s", change)
        return change

    def coefficients(self, t: int) -> tuple[float, float, float]:
        return (1.0, 0.0, 0.0) if self.rl else super().coefficients(t)

    def step(self, theta: np.ndarray, m: np.ndarray | None, g: np.ndarray, t: int = 1,
             divisor: float = 1.0) -> bool:
        if self.rl:  # plain averaging: the momentum is neither read nor written
            return kernels.outer_step(theta, None, g, 1.0, 0.0, 0.0, divisor)
        return super().step(theta, m, g, t, divisor)


class AgreementNesterov(Nesterov):
    """Nesterov whose step moves between plain averaging and (lr, μ) with the agreement
    of the round's merged change g with the momentum m (the pseudo-gradients before
    it): s = max(0, cos(g, m)), lr_t = 1 + (lr − 1)·s, μ_t = μ·s. An empty m (round 1)
    gives s = 0, plain averaging; m is then g itself, so round 2's s is the cosine of
    two successive pseudo-gradients. The idea: an outer lr adapted
    from the agreement of successive pseudo-gradients; the test is the one of adaptive
    restart (O'Donoghue & Candès, "Adaptive Restart for Accelerated Gradient Schemes",
    arXiv 1204.3982), made continuous. No state beyond m and t: s is computed from
    them each round."""

    name = "nesterov-agree"

    def __init__(self, lr: float = 1.0, momentum: float = 0.0):
        super().__init__(lr, momentum)
        self.agreement = 0.0  # s of the round being stepped

    def begin(self, g: np.ndarray, m: np.ndarray | None, t: int) -> None:
        self.agreement = max(0.0, cosine(g, m)) if m is not None else 0.0

    def coefficients(self, t: int) -> tuple[float, float, float]:
        s = self.agreement
        mu = self.momentum * s
        return 1.0 + (self.lr - 1.0) * s, mu, mu


class RestartNesterov(Nesterov):
    """Nesterov with gradient-based adaptive restart (O'Donoghue & Candès, "Adaptive
    Restart for Accelerated Gradient Schemes", arXiv 1204.3982, §3.2): when the round's
    merged change g points against the momentum (g·m < 0: the last steps overshot),
    m is emptied before m ← μm + g, so the step is lr·(1 + μ)·g. No state beyond m:
    the test is made on g and m each round."""

    name = "nesterov-restart"

    def __init__(self, lr: float = 1.0, momentum: float = 0.0):
        super().__init__(lr, momentum)
        self.restart = False  # for the round being stepped

    def begin(self, g: np.ndarray, m: np.ndarray | None, t: int) -> None:
        self.restart = m is not None and cosine(g, m) < 0

    def coefficients(self, t: int) -> tuple[float, float, float]:
        return self.lr, 0.0 if self.restart else self.momentum, self.momentum  # μ 0: m ← g


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """cos(a, b), 0 when either is zero (f64 sums over f32 chunks: no full-size copy)."""
    dot = na = nb = 0.0
    for lo in range(0, a.size, 1 << 20):
        x, y = a[lo:lo + (1 << 20)], b[lo:lo + (1 << 20)]
        dot += float(np.dot(x, y))
        na += float(np.dot(x, x))
        nb += float(np.dot(y, y))
    return dot / float(np.sqrt(na * nb)) if na > 0 and nb > 0 else 0.0


OPTIMIZERS = {o.name: o for o in (RegimeNesterov, Nesterov, BiasCorrectedNesterov,
                                  WarmupNesterov, AgreementNesterov, RestartNesterov)}
REGIMES = ("sft", "rl")  # what an island declares it trains (JoinRequest.regime)


def outer_optimizer(name: str, lr: float, momentum: float) -> Nesterov:
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown outer optimizer {name!r}; use one of "
                         f"{', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name](lr, momentum)
