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

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class TransportError(RuntimeError):
    """A call to the syncer failed; the subclass says how."""


class Refused(TransportError):
    """The syncer refused the call; retrying it unchanged will not help."""


class Lost(TransportError):
    """Sent, but the reply never came; the syncer may or may not hold it."""


class Unavailable(TransportError):
    """Not connected to the syncer; nothing was sent."""


@dataclass(frozen=True)
class Received:
    """One broadcast of fragment `fragment` of Θ (`theta` is that fragment's slice)."""

    version: int
    fragment: int
    final: bool
    theta: np.ndarray


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
    `bytes_up`, `bytes_down`, `wait_s`.
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

    def start(self, initial: np.ndarray) -> None:
        """Join in the background; `initial` seeds Θ if the syncer asks for it."""

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
