"""What an island needs from the syncer, as an interface: join, push, receive, finish.

`yeto.island.Island` talks only to this interface. `yeto.client.SyncerClient` is the
gRPC implementation; an in-process one (a whole fleet in one process) implements
the same few methods. Errors are typed, so the island decides what a failed push
means without knowing the transport:

- `Refused`: the syncer refused the call (bad layout, token, stale round, malformed
  push). Retrying the same call will not help; a refused push's work is carried
  into the next push.
- `Lost`: the call went out but no reply came (the connection dropped). Whether the
  syncer holds it shows on the next join (`acked_seq`).
- `Unavailable`: not connected; nothing was sent.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import numpy as np

# the most schedules of H steps one push claims beyond the commits its island missed since
# its last accepted push: the syncer refuses more (`syncer.bounds.Bounds.claims`), and an
# island's push claims at most this many H (work carried past it counts no tokens)
CARRY_SLACK = 2
# in the syncer's refusal of a push whose claim passes that: the island then cuts the
# claim it carries into its next push (`yeto.island.ledger`)
OVER_SCHEDULE = "more steps than its schedule allows"


class TransportError(RuntimeError):
    """A call to the syncer failed; the subclass says how."""


class Refused(TransportError):
    """The syncer refused the call; retrying it unchanged will not help."""


class Lost(TransportError):
    """Sent, but the reply never came; the syncer may or may not hold it."""


class Unavailable(TransportError):
    """Not connected to the syncer; nothing was sent."""


class ThetaStream:
    """A fragment of Θ arriving piece by piece: float32 arrays, in order, covering
    `numel` values. The island applies each piece as it comes (at a step boundary),
    so no copy of the whole fragment is ever held; the transport's receiver waits
    while `depth` pieces are waiting to be taken.

    Producer (the transport): `put`, then `end` or `fail`. Consumer (the island):
    `pieces()` once, or `discard()` when it does not want the broadcast.
    """

    def __init__(self, numel: int, depth: int = 2, stall_s: float = 300.0):
        self.numel, self.depth, self.stall_s = int(numel), max(1, depth), stall_s
        self._cond = threading.Condition()
        self._queue: collections.deque[np.ndarray] = collections.deque()
        self._ended = self._discarded = False
        self._error: str | None = None

    # ---- producer -----------------------------------------------------------
    def put(self, piece: np.ndarray, alive: Callable[[], bool] = lambda: True) -> bool:
        """Queue one piece, waiting while the queue is full; False when the consumer
        discarded the stream or `alive()` turned false (stop sending)."""
        with self._cond:
            while len(self._queue) >= self.depth and not self._discarded and alive():
                self._cond.wait(timeout=0.5)
            if self._discarded or not alive():
                return False
            self._queue.append(piece)
            self._cond.notify_all()
            return True

    def end(self) -> None:
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def fail(self, why: str) -> None:
        with self._cond:
            if not self._ended:
                self._error = why
            self._cond.notify_all()

    # ---- consumer -----------------------------------------------------------
    def pieces(self) -> Iterator[np.ndarray]:
        """The pieces in order; raises `Lost` when the broadcast breaks off."""
        got = 0
        while True:
            with self._cond:
                t0 = time.monotonic()
                while not (self._queue or self._ended or self._error):
                    if time.monotonic() - t0 > self.stall_s:
                        raise Lost(f"broadcast stalled after {got} of {self.numel} values")
                    self._cond.wait(timeout=0.5)
                if self._queue:
                    piece = self._queue.popleft()
                    self._cond.notify_all()
                elif self._error:
                    raise Lost(f"broadcast broke off after {got} of {self.numel} values: "
                               f"{self._error}")
                else:
                    if got != self.numel:
                        raise Lost(f"broadcast ended after {got} of {self.numel} values")
                    return
            got += piece.size
            yield piece

    def discard(self) -> None:
        with self._cond:
            self._discarded = True
            self._queue.clear()
            self._cond.notify_all()


@dataclass(frozen=True)
class Received:
    """One broadcast of fragment `fragment` of Θ: `theta` is that fragment's slice,
    whole (np.ndarray, read-only to the island) or as a `ThetaStream` (large
    broadcasts, when the island asked the transport for streams)."""

    version: int
    fragment: int
    final: bool
    theta: np.ndarray | ThetaStream


@dataclass(frozen=True)
class PushReply:
    """The syncer's answer to a push: `status` is "accepted", "duplicate", ..."""

    accepted: bool
    status: str
    round: int = 0
    staleness: int = 0

    @property
    def kept(self) -> bool:
        """True when the syncer holds this push's work (now or from an earlier send)."""
        return self.accepted or self.status == "duplicate"


class Transport(Protocol):
    """The island's view of one syncer connection (see the module docstring).

    Attributes a transport keeps up to date: `address` (for messages), `connected`
    (set while joined), `num_fragments` (the run's P), `generation` (bumps on every
    rejoin), `acked_seq` (newest push seq the syncer holds, from the last join),
    `fatal` (a refusal that ends the island's part in the run, else None),
    `last_error` (the most recent connection error, for messages), and the counters
    `bytes_up`, `bytes_down`, `wait_s`. `background_pushes`: True when pushes go out
    on a thread of the transport's own (the island then encodes them in the background
    too; default False).

    Implementations subclass `Transport`, which gives them the defaults of
    `background_pushes` and `stream_broadcasts`.
    """

    address: str
    connected: threading.Event
    num_fragments: int
    generation: int
    acked_seq: int
    fatal: str | None
    last_error: str | None
    bytes_up: int
    bytes_down: int
    wait_s: float
    background_pushes: bool = False

    def stream_broadcasts(self) -> None:
        """From now on large broadcasts may be handed over as `ThetaStream`s (applied as
        they arrive) instead of whole arrays. Default: whole arrays only."""

    def start(self, initial: np.ndarray) -> None:
        """Join in the background; `initial` seeds Θ if the syncer asks for it."""

    def generation_for(self, fragment: int) -> int:
        """The connection generation pushes of `fragment` go out on (`generation`, but
        for a sharded run: its owner's)."""

    def acked_seq_for(self, fragment: int) -> int:
        """The newest push seq the syncer owning `fragment` holds (`acked_seq`, but for
        a sharded run: its owner's)."""

    def take(self) -> list[Received]:
        """The newest broadcast of each fragment not yet taken (maybe none)."""

    def wait(self, timeout: float | None, need_connection: bool = False) -> list[Received]:
        """Block until a broadcast arrives, or timeout / fatal error / close (then [])."""

    def push(self, payload: bytes, *, encoding: str, base_version: int, loss_tokens: int,
             steps: int, seq: int, fragment: int = 0, numel: int | None = None,
             train_loss: float = float("nan"), eval_loss: float = float("nan")) -> Future:
        """Send one pseudo-gradient; the future gives a `PushReply` or raises a
        `TransportError`."""

    def finish(self) -> None:
        """Tell the syncer this island trained its last step."""

    def close(self) -> None:
        """Stop background work and release the connection."""
