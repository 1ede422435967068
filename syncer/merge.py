"""Merge rules (token-weighted mean, uniform, norm-preserving RDA) and the outer
Nesterov step. Pure numpy; memory per round is one accumulator, whatever the
number of islands."""

from __future__ import annotations

import numpy as np

from yeto import codec

MERGE_RULES = ("mean", "uniform", "rda")


class MergeAccumulator:
    """Accumulates Σ wᵢΔᵢ as pushes arrive.

    mean:    wᵢ = loss tokens, g = Σ wᵢΔᵢ / Σ wᵢ
    uniform: wᵢ = 1
    rda:     the mean's direction, rescaled so that ‖g‖ = Σ wᵢ‖Δᵢ‖ / Σ wᵢ
             (averaging shrinks disagreeing updates; this keeps their typical size).
    """

    def __init__(self, numel: int, rule: str = "mean", clip_factor: float = 0.0):
        if rule not in MERGE_RULES:
            raise ValueError(f"unknown merge rule {rule!r}; use one of {', '.join(MERGE_RULES)}")
        self.numel, self.rule, self.clip_factor = numel, rule, float(clip_factor)
        self.sum: np.ndarray | None = None
        self.total_weight = 0.0
        self.norm_sum = 0.0
        self.count = 0
        # clipping needs the round's median norm, known only at commit: pushes are
        # then kept as received (compressed) until the round commits
        self.held: list[tuple[bytes, str, float, float]] = []
        self.clipped: list[float] = []

    def weight_for(self, loss_tokens: int) -> float:
        return 1.0 if self.rule == "uniform" else float(max(loss_tokens, 0))

    def add(self, payload, encoding: str, loss_tokens: int) -> float:
        """Decode and add one push; returns the weight it got. Validates first, so
        a bad payload raises CodecError and leaves the sum untouched."""
        w = self.weight_for(loss_tokens)
        if self.clip_factor > 0:
            norm = float(np.linalg.norm(codec.decode(payload, encoding, self.numel)))
            self.held.append((bytes(payload), encoding, w, norm))
            self.total_weight += w
            self.count += 1
            return w
        if self.rule == "rda":
            delta = codec.decode(payload, encoding, self.numel)
            self._buffer()
            self.norm_sum += w * float(np.linalg.norm(delta))
            self.sum += w * delta
        else:
            codec.validate(payload, encoding, self.numel)
            codec.decode_add(payload, encoding, self.numel, self._buffer(), w)
        self.total_weight += w
        self.count += 1
        return w

    def _buffer(self) -> np.ndarray:
        if self.sum is None:
            self.sum = np.zeros(self.numel, dtype=np.float32)
        return self.sum

    def result(self) -> np.ndarray:
        """The merged pseudo-gradient g (reuses the accumulator's buffer)."""
        if self.held:
            self._merge_clipped()
        if self.sum is None:
            raise RuntimeError("no pushes to merge")
        if self.total_weight <= 0:  # every push reported 0 loss tokens: fall back to uniform
            raise ValueError("all pushes carry zero weight (0 loss tokens)")
        g = self.sum
        g /= self.total_weight
        if self.rule == "rda":
            norm = float(np.linalg.norm(g))
            if norm > 0:
                g *= (self.norm_sum / self.total_weight) / norm
        return g


    def _merge_clipped(self) -> None:
        """Scale each held push to norm ≤ clip_factor × the round's median norm."""
        limit = self.clip_factor * float(np.median([h[3] for h in self.held]))
        self.sum = np.zeros(self.numel, dtype=np.float32)
        for payload, encoding, w, norm in self.held:
            scale = min(1.0, limit / norm) if norm > 0 else 1.0
            self.clipped.append(scale)
            codec.decode_add(payload, encoding, self.numel, self.sum, w * scale)
            self.norm_sum += w * norm * scale
        self.held.clear()


class NesterovOuter:
    """m ← μm + g;  Θ ← Θ − lr·(g + μm).  lr 1, μ 0 is plain averaging."""

    def __init__(self, lr: float = 0.7, momentum: float = 0.9):
        self.lr, self.momentum = float(lr), float(momentum)

    def step(self, theta: np.ndarray, m: np.ndarray, g: np.ndarray) -> None:
        """In place on theta and m; g is used as scratch (no full-size temporaries)."""
        m *= np.float32(self.momentum)
        m += g
        g *= np.float32(self.lr)
        theta -= g
        np.multiply(m, np.float32(self.lr * self.momentum), out=g)
        theta -= g
