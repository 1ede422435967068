"""The adaptive grace window (`--grace auto`): how long a round waits, after its
quorum has pushed, for the live islands that have not.

Waiting w seconds for island j brings j's next push (its tokens, T_j) into this
round; it costs the islands that already pushed w seconds of training on the old Θ,
about w × Σ rate_i tokens (rate_i: island i's loss tokens per second between its
pushes). So the round waits for j only while that costs less than it brings:

    wait for j  iff  eta_j - quorum_at <= T_j / Σ_{i pushed} rate_i

and commits at the latest such arrival (each eta padded by `SLACK` of the island's
push interval, so that ordinary jitter does not cost a round). eta_j is j's last push
plus its push interval, both measured per fragment from the pushes themselves (an
exponential moving average). An island without two pushes yet, or a round whose
pushers have no measured rate, gets the fixed `--grace-ms`.

For equal islands this waits up to 1/(k-1) of a round for a late one; an island three
times slower than the rest is not waited for (it would cost two rounds of everyone
else's work), and its push joins a later round as stale (`--max-staleness`), or is
refused when too stale: such fleets sync by wall time (`--sync-every-seconds`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

SLACK = 0.1       # of an island's push interval, added to its expected arrival
SMOOTHING = 0.5   # weight of the newest interval / token count in the moving averages


@dataclass
class Pace:
    """One island's pushes of one fragment, as the syncer saw them arrive."""

    last_push: float
    interval: float | None = None  # seconds between pushes (moving average)
    tokens: float = 0.0            # loss tokens per push (moving average)

    @property
    def rate(self) -> float | None:
        return self.tokens / self.interval if self.interval else None


class AutoGrace:
    def __init__(self, fallback_s: float):
        self.fallback_s = fallback_s
        self.paces: dict[tuple[str, int], Pace] = {}

    def observe(self, learner: str, fragment: int, now: float, tokens: int) -> None:
        """Record a push accepted at `now` carrying `tokens` loss tokens."""
        p = self.paces.get((learner, fragment))
        if p is None:
            self.paces[(learner, fragment)] = Pace(now, None, float(tokens))
            return
        dt = now - p.last_push
        if dt > 0:
            p.interval = dt if p.interval is None else _ema(p.interval, dt)
        p.tokens = _ema(p.tokens, float(tokens))
        p.last_push = now

    def wait_s(self, fragment: int, quorum_at: float, pushed: Iterable[str],
               missing: Iterable[str]) -> float:
        """Seconds after `quorum_at` the round of `fragment` waits for `missing`."""
        if not missing:
            return 0.0
        rates = [self._rate(i, fragment) for i in pushed]
        known = [r for r in rates if r is not None]
        if not rates or len(known) < len(rates) or sum(known) <= 0:
            return self.fallback_s
        worth_per_token = 1.0 / sum(known)  # seconds of the pushers' work per token
        waits = [0.0]
        for j in missing:
            p = self.paces.get((j, fragment))
            if p is None or p.interval is None:
                return self.fallback_s
            due = p.last_push + p.interval * (1 + SLACK) - quorum_at
            if due <= p.tokens * worth_per_token:
                waits.append(due)
        return max(waits)

    def _rate(self, learner: str, fragment: int) -> float | None:
        p = self.paces.get((learner, fragment))
        return None if p is None else p.rate


def _ema(old: float, new: float) -> float:
    return (1 - SMOOTHING) * old + SMOOTHING * new
