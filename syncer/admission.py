"""Which streaming calls the syncer takes, and for how long a silent one may hold on.

A streaming call holds one of the server's worker threads for as long as it lasts,
and a push also one of the `--max-inflight-pushes` slots. So that no peer, hostile or
merely stuck, can starve the others:

- at most `max_streams` streaming calls at once in all, `per_island` for any one
  learner id, and one push per learner id (an island pushes one at a time: a
  hostile one holds at most one of the push slots); a call over a bound is refused
  at once (RESOURCE_EXHAUSTED, the island retries), and the server keeps
  `UNARY_WORKERS` threads beyond `max_streams`, so Join, Heartbeat and Status always
  find a worker;
- a push that sends nothing for `idle_s` seconds (no header, or a header and then
  nothing) is cancelled and its slot freed; the server's keepalive pings end the
  connections of peers that stopped answering (a frozen process, a dead link).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Protocol

log = logging.getLogger("syncer")

UNARY_WORKERS = 16  # worker threads kept for unary calls beyond the streams' bound


class Exhausted(Exception):
    """A streaming call over a bound; the message says which."""


class Call(Protocol):
    """A streaming call as admitted: a gRPC context, or a direct-port stream."""

    def cancel(self) -> object: ...


class Watch:
    """One admitted streaming call: when it last moved, and whether it was cut off."""

    def __init__(self, context: Call, learner_id: str | None,
                 idle_s: float | None):
        self.context, self.learner_id, self.idle_s = context, learner_id, idle_s
        self.last = time.monotonic()
        self.expired = False

    def touch(self) -> None:
        self.last = time.monotonic()


class Streams:
    def __init__(self, max_streams: int = 128, per_island: int = 4, idle_s: float = 60.0):
        self.max_streams, self.per_island, self.idle_s = max_streams, per_island, idle_s
        self._lock = threading.Lock()
        self._open: set[Watch] = set()
        self._per: collections.Counter[str] = collections.Counter()
        self._pushing: set[str] = set()  # learner ids with a push in progress

    @contextlib.contextmanager
    def admit(self, context: Call, learner_id: str | None, push: bool = True
              ) -> Iterator[Watch]:
        """Hold one stream slot for the `with` block, or raise Exhausted. `learner_id`:
        the authenticated caller (None without authentication: the total bound only).
        `push`: a push (one per island at once; cancelled when it receives nothing for
        `idle_s`, see `Watch.touch`), else a broadcast stream."""
        with self._lock:
            self._check(learner_id, push)
            watch = Watch(context, learner_id, self.idle_s if push else None)
            self._open.add(watch)
            if learner_id is not None:
                self._per[learner_id] += 1
                if push:
                    self._pushing.add(learner_id)
        try:
            yield watch
        finally:
            with self._lock:
                self._open.discard(watch)
                if learner_id is not None:
                    self._per[learner_id] -= 1
                    if self._per[learner_id] <= 0:
                        del self._per[learner_id]
                    if push:
                        self._pushing.discard(learner_id)

    def _check(self, learner_id: str | None, push: bool) -> None:
        if len(self._open) >= self.max_streams:
            raise Exhausted(f"the syncer serves {self.max_streams} streams at once "
                            "(--max-streams); retry later")
        if learner_id is None:
            return
        if self._per[learner_id] >= self.per_island:
            raise Exhausted(f"{learner_id!r} already has {self.per_island} streams open "
                            "at the syncer; retry once they end")
        if push and learner_id in self._pushing:
            raise Exhausted(f"{learner_id!r} already has a push in progress; an island "
                            "pushes one at a time (retry once it ends)")

    def reap(self) -> int:
        """Cancel the calls idle past their bound; returns how many."""
        now = time.monotonic()
        with self._lock:
            idle = [w for w in self._open if w.idle_s is not None and not w.expired
                    and now - w.last > w.idle_s]
            for w in idle:
                w.expired = True
        for w in idle:
            log.warning("a push stream from %r sent nothing for %.0f s: cancelled, its slot "
                        "freed", w.learner_id or "?", w.idle_s)
            w.context.cancel()
        return len(idle)
