"""The fleet and its failures for the fleet-scale model (`yeto.sim.scale`).

`Fleet` is what does not change during a run: each island's step time and link.
`FailureTrace` is what happens to it: island crashes (down for a restart time) and
slow-link episodes (bandwidth divided by a factor for a while), drawn once from a seed
so that the DiLoCo arm and the synchronous data-parallel arm meet the same failures
at the same simulated seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HOUR = 3600.0


@dataclass(frozen=True)
class Fleet:
    """Per island: `step_s` (simulated seconds per inner step), `bandwidth` (bytes per
    second each way of its link) and `latency` (seconds, one way)."""

    step_s: np.ndarray
    bandwidth: np.ndarray
    latency: np.ndarray

    def __post_init__(self):
        n = len(self.step_s)
        if n < 1:
            raise ValueError("a fleet has at least one island")
        if len(self.bandwidth) != n or len(self.latency) != n:
            raise ValueError("step_s, bandwidth and latency need one value per island")
        if np.any(self.step_s <= 0) or np.any(self.bandwidth <= 0) or np.any(self.latency < 0):
            raise ValueError("step times and bandwidths must be > 0, latencies >= 0")

    @property
    def islands(self) -> int:
        return len(self.step_s)

    @classmethod
    def uniform(cls, islands: int, step_s: float, bandwidth: float, latency: float,
                speed_spread: float = 0.0, seed: int = 0) -> Fleet:
        """`islands` alike but for their speed: island i's step takes `step_s` times a
        factor drawn uniformly from [1, 1 + speed_spread] (seeded), fixed for the run."""
        if speed_spread < 0:
            raise ValueError("speed_spread must be >= 0")
        rng = np.random.default_rng([seed, 1])
        factors = 1.0 + speed_spread * rng.random(islands)
        return cls(step_s * factors, np.full(islands, float(bandwidth)),
                   np.full(islands, float(latency)))

    def paid_steps(self, seconds: float) -> float:
        """Island-steps paid for in `seconds`: every island's time at its nominal speed,
        whether it trains, waits or is down."""
        return float(np.sum(seconds / self.step_s))


@dataclass
class FailureTrace:
    """Per island, its crashes as (down_at, up_at) and its slow-link episodes as
    (start, end), each list sorted and non-overlapping; during an episode the island's
    bandwidth is divided by `slow_factor`. An island is down in [down_at, up_at): it
    loses what it held and comes back as a fresh process at `up_at`."""

    crashes: list[list[tuple[float, float]]]
    slow: list[list[tuple[float, float]]]
    slow_factor: float = 1.0

    def __post_init__(self):
        if len(self.crashes) != len(self.slow):
            raise ValueError("crashes and slow episodes need one list per island")
        if self.slow_factor < 1:
            raise ValueError("slow_factor must be >= 1 (a slow link is slower)")
        for spans in (*self.crashes, *self.slow):
            for (a, b), nxt in zip(spans, [*spans[1:], None]):
                if not 0 <= a < b or (nxt is not None and nxt[0] < b):
                    raise ValueError(f"spans must be sorted, non-empty and apart: {spans}")

    @classmethod
    def none(cls, islands: int) -> FailureTrace:
        return cls([[] for _ in range(islands)], [[] for _ in range(islands)])

    @classmethod
    def draw(cls, islands: int, seconds: float, crash_rate: float, restart_s: float,
             slow_rate: float = 0.0, slow_s: float = 0.0, slow_factor: float = 1.0,
             seed: int = 0) -> FailureTrace:
        """Crashes at `crash_rate` per island-hour of uptime (a Poisson process: the
        time up before a crash is exponential), each down `restart_s`; slow-link episodes
        at `slow_rate` per island-hour outside an episode, each `slow_s` long. Seeded by
        `seed` alone: the same arguments give the same trace."""
        if min(crash_rate, slow_rate) < 0 or restart_s <= 0 or slow_s < 0:
            raise ValueError("rates and durations must be >= 0 (restart_s > 0)")
        rng = np.random.default_rng([seed, 2])
        crashes = [_spans(rng, seconds, crash_rate, restart_s) for _ in range(islands)]
        slow = [_spans(rng, seconds, slow_rate, slow_s) if slow_s > 0 else []
                for _ in range(islands)]
        return cls(crashes, slow, slow_factor)


def _spans(rng: np.random.Generator, seconds: float, rate_per_hour: float,
           length: float) -> list[tuple[float, float]]:
    """Spans of `length` starting after exponential gaps (mean 1/rate) outside a span."""
    out: list[tuple[float, float]] = []
    if rate_per_hour <= 0:
        return out
    t = 0.0
    while True:
        t += rng.exponential(HOUR / rate_per_hour)
        if t >= seconds:
            return out
        out.append((t, t + length))
        t += length
