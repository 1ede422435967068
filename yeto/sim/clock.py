"""Simulated time for a fleet in one process (`python -m yeto.sim --step-seconds S`).

Each island keeps its own time: a step at speed s costs s × S simulated seconds,
whatever the machine's real speed. The island whose step ends first goes next, one at
a time (ties: by name), so what islands send reaches the syncer in the order of
simulated time. The fleet's time — the syncer's clock: grace windows, round timeouts,
push intervals — is the least time of the islands that are stepping; when it moves on,
the island whose turn it is tells the syncer (`on_advance`) before it goes on, so a
round's grace window ends at the same point of every run.

An island that waits for the syncer (a round to commit, the next weights) steps aside.
A commit holds every step until each island still in the fleet has been handed the new
weights, so a broadcast takes no simulated time, and an island it wakes resumes at the
fleet's time; the gap counts as waiting, not training (goodput). When every island
waits, `pass_idle_time` moves the fleet's time on to the syncer's next deadline (a
grace window or a round timeout that ends).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("yeto.sim")
HOLD_WARN_S = 60.0  # real seconds a commit may hold the fleet before it says so


class VirtualClock:
    def __init__(self):
        self.on_advance: Callable[[float], None] = lambda now: None  # e.g. the syncer's tick
        self._cond = threading.Condition()
        self._time: dict[str, float] = {}   # island -> the end of its current step
        self._fleet = 0.0
        self._told = 0.0                    # the fleet's time on_advance last heard
        self._in: set[str] = set()          # islands in the fleet (not left)
        self._stepping: set[str] = set()    # ... and not waiting for the syncer
        self._started: set[str] = set()     # ... past their first step
        self._owed: dict[str, dict[int, int]] = {}  # island -> fragment -> version
        self.trained: dict[str, float] = {}  # island -> simulated seconds of steps
        self.waited: dict[str, float] = {}   # island -> simulated seconds waiting
        self.last_step: dict[str, float] = {}  # island -> when its last step ended

    # ---- reading ----------------------------------------------------------
    def now(self) -> float:
        """The calling island's time; the fleet's time for any other thread."""
        with self._cond:
            return self._time.get(threading.current_thread().name, self._fleet)

    def fleet_now(self) -> float:
        with self._cond:
            return self._fleet

    def idle(self) -> bool:
        """True when every island still in the fleet waits for the syncer."""
        with self._cond:
            return bool(self._in) and not self._stepping and not self._owed

    def goodput(self) -> dict[str, float]:
        """Per island: the share of its time, up to its last step, spent training."""
        with self._cond:
            return {n: self.trained[n] / self.last_step[n] for n in self.last_step}

    # ---- the fleet's side -------------------------------------------------
    def expect(self, names: list[str]) -> None:
        """The islands (by thread name), all at time 0: none steps until every one has
        started (joined, got Θ) or left, so that the fleet starts together."""
        with self._cond:
            for n in names:
                self._time[n], self.trained[n], self.waited[n] = 0.0, 0.0, 0.0
            self._in |= set(names)
            self._stepping |= set(names)

    def committed(self, fragment: int, version: int) -> None:
        """A new version: hold every step until each island has been handed it."""
        with self._cond:
            for n in self._in:
                self._owed.setdefault(n, {})[fragment] = version

    def delivered(self, name: str, fragment: int, version: int) -> None:
        """Island `name` was handed `version` of `fragment`: a waiting island wakes
        (at the fleet's time) before the hold lifts."""
        with self._cond:
            owed = self._owed.get(name, {})
            if owed.get(fragment, version + 1) <= version:
                del owed[fragment]
                if not owed:
                    del self._owed[name]
            if name in self._started and name not in self._stepping:
                self._catch_up(name)
            self._settle()

    def pass_idle_time(self, until: float | None) -> None:
        """Every island waits: move the fleet's time on to `until` (the syncer's next
        deadline; None: nothing is due, so time stands still)."""
        with self._cond:
            if self._stepping or self._owed or until is None or until <= self._fleet:
                return
            now = self._fleet = self._told = until
        self.on_advance(now)

    # ---- an island's side -------------------------------------------------
    def step(self, cost: float) -> None:
        """Before each of the calling island's steps: the step ends `cost` later; wait
        until it is the first to end."""
        name = threading.current_thread().name
        with self._cond:
            self._started.add(name)
            self._time[name] += cost
            self.trained[name] += cost
            self.last_step[name] = self._time[name]
            self._settle()
        self._wait_turn(name)

    @contextlib.contextmanager
    def waiting(self):
        """Around a wait for the syncer: the calling island steps aside meanwhile (not
        before its first step: the fleet starts together)."""
        name = threading.current_thread().name
        with self._cond:
            joined = name in self._started and name in self._stepping
            if joined:
                self._stepping.discard(name)
            self._settle()
        try:
            yield
        finally:
            if joined:
                with self._cond:
                    if name not in self._stepping:  # woken by other than a broadcast
                        self._catch_up(name)
                self._wait_turn(name)

    def leave(self) -> None:
        """The calling island is done: the others no longer wait for it."""
        name = threading.current_thread().name
        with self._cond:
            for s in (self._in, self._stepping, self._started):
                s.discard(name)
            self._owed.pop(name, None)
            self._settle()

    # ---- inside -----------------------------------------------------------
    def _wait_turn(self, name: str) -> None:
        """Wait until no broadcast is owed and this island's step ends first; if the
        fleet's time moved on meanwhile, tell the syncer first (nobody else steps)."""
        t0 = time.monotonic()
        self._cond.acquire()
        try:
            while True:
                if self._owed or self._first() != name:
                    if not self._cond.wait(HOLD_WARN_S) and time.monotonic() - t0 > HOLD_WARN_S:
                        log.warning("%s has waited %.0f s for its turn (broadcasts owed: %s)",
                                    name, time.monotonic() - t0, self._owed)
                    continue
                if self._fleet <= self._told:
                    return
                now = self._told = self._fleet
                self._cond.release()
                try:
                    self.on_advance(now)  # may commit: then broadcasts are owed
                finally:
                    self._cond.acquire()
        finally:
            self._cond.release()

    def _catch_up(self, name: str) -> None:
        """(Under the lock) a waiting island resumes at the fleet's time."""
        before = self._time[name]
        self._time[name] = max(before, self._fleet)
        self.waited[name] += self._time[name] - before
        self._stepping.add(name)

    def _first(self) -> str | None:
        return min(self._stepping, key=lambda n: (self._time[n], n), default=None)

    def _settle(self) -> None:
        """(Under the lock) the fleet's time anew; wakes whoever's turn it is. While a
        broadcast is owed the fleet's time stands: an island already past it could
        otherwise carry it on before the islands it wakes are back among the steppers,
        and they would resume late, as if they had waited (how long, the machine's
        load would decide)."""
        first = self._first()
        if first is not None and not self._owed:
            self._fleet = max(self._fleet, self._time[first])
        self._cond.notify_all()
