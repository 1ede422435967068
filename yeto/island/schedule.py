"""When each fragment of an island is due for a push: fragment f of P every H steps,
offset by f·H/P (Streaming DiLoCo), or every T seconds with the same stagger (islands
of mixed speed then push at the same rate, and token weighting lets the faster one
count for more)."""

from __future__ import annotations

import time
from collections.abc import Callable


class Schedule:
    """`sync_every` H steps, or `sync_every_seconds` T > 0 of `clock` (`yeto.sim`:
    simulated time)."""

    def __init__(self, sync_every: int, sync_every_seconds: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        if sync_every < 1:
            raise ValueError("sync_every must be >= 1")
        self.sync_every, self.sync_every_seconds = sync_every, float(sync_every_seconds)
        self.clock = clock
        self._t0 = clock()
        self._next_due: dict[int, float] = {}

    def restart(self) -> None:
        """Count the seconds from now (the island has joined)."""
        self._t0 = self.clock()

    def due(self, step: int, p: int) -> list[int]:
        """The fragments (of `p`) to push after step `step`."""
        if self.sync_every_seconds > 0:
            now, period = self.clock(), self.sync_every_seconds
            due = []
            for f in range(p):
                nxt = self._next_due.setdefault(f, self._t0 + period * (f + 1) / p)
                if now >= nxt:
                    due.append(f)
                    self._next_due[f] = now + period
            return due
        offsets = [((f + 1) * self.sync_every) // p for f in range(p)]  # the last is H
        return [f for f in range(p)
                if step >= offsets[f] and (step - offsets[f]) % self.sync_every == 0]
