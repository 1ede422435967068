"""`ShardedClient`: one island's transport to a run served by several syncers, each the
owner of some fragments (`syncer.shards`). It holds one `SyncerClient` per shard, given
in order ('A;B'; each may list standbys: 'A,A2;B,B2'), joins them all, pushes each
fragment to its owner and takes broadcasts from all of them. A shard map that does not
fit (a shard at the wrong position, shards that deal the fragments differently, a
count that differs from the addresses given) ends the island's part in the run with
one message saying so."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from yeto import net
from yeto.client.sender import seed_sha256
from yeto.client.syncer_client import SyncerClient
from yeto.layout import Layout
from yeto.proto import yeto_pb2 as pb
from yeto.transport import Received, Transport


class AllSet:
    """`connected` of several links: set while every one of them is."""

    def __init__(self, events: list[threading.Event]):
        self.events = events

    def is_set(self) -> bool:
        return all(e.is_set() for e in self.events)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for e in self.events:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not e.wait(left):
                return False
        return True


class ShardedClient(Transport):
    """`yeto.transport.Transport` over one `SyncerClient` per shard."""

    def __init__(self, syncer: str, learner_id: str, layout: Layout,
                 connect: Callable[..., SyncerClient] = SyncerClient, **options):
        """`connect(address, learner_id, layout, **options)`: each shard's client (a
        `SyncerClient` over gRPC; `yeto.sim` gives in-process ones)."""
        addresses = net.shard_entries(syncer)
        if len(addresses) < 2:
            raise ValueError(f"--syncer {syncer!r}: a sharded run lists two or more shards "
                             "separated by ';'")
        self.address, self.learner_id, self.layout = syncer, learner_id, layout
        self._lock = threading.Lock()
        self.owner: list[int] | None = None  # the shard owning each fragment, once known
        self.cond = threading.Condition()  # every shard's connection notifies it
        self.clients = [connect(a, learner_id, layout, shard=i, check_join=self._check_map,
                                cond=self.cond, **options)
                        for i, a in enumerate(addresses)]
        self.connected = AllSet([c.connected for c in self.clients])
        self.background_pushes = self.clients[0].background_pushes

    def _check_map(self, reply: pb.JoinReply) -> str | None:
        """What is wrong with a shard's join reply as the map the others gave."""
        count = len(self.clients)
        if max(1, reply.shards) != count:
            return (f"wrong shard map: --syncer lists {count} shards, the syncer at position "
                    f"{reply.shard} serves shard {reply.shard} of {max(1, reply.shards)}")
        owner = list(reply.fragment_owner)
        if len(owner) != reply.num_fragments or any(o >= count for o in owner):
            return f"shard {reply.shard} sent a fragment map that does not fit its run"
        with self._lock:
            if self.owner is None:
                self.owner = owner
            elif owner != self.owner:
                return ("wrong shard map: the shards deal the fragments differently (are "
                        "they serving the same run, with the same --fragments?)")
        return None

    def _of(self, fragment: int) -> SyncerClient:
        if self.owner is None:
            raise RuntimeError("no shard has answered a join yet")
        return self.clients[self.owner[fragment]]

    # ---- what the transport keeps up to date (yeto.transport.Transport) -------------
    @property
    def generation(self) -> int:
        """Changes whenever any shard's connection does (a rejoin anywhere)."""
        return hash(tuple(c.generation for c in self.clients))

    def generation_for(self, fragment: int) -> int:
        return self._of(fragment).generation

    @property
    def acked_seq(self) -> int:
        """The newest push seq any shard holds (the next push's seq comes after it)."""
        return max(c.acked_seq for c in self.clients)

    def acked_seq_for(self, fragment: int) -> int:
        return self._of(fragment).acked_seq

    @property
    def run_id(self) -> str:
        return self.clients[0].run_id

    @property
    def num_fragments(self) -> int:
        """The run's fragments, from whichever shard answered a join first (every shard
        gives the same count: `_check_map`; one not joined yet says 1)."""
        return max(c.num_fragments for c in self.clients)

    @property
    def fatal(self) -> str | None:
        return next((c.fatal for c in self.clients if c.fatal), None)

    @property
    def last_error(self) -> str | None:
        return next((c.last_error for c in self.clients if c.last_error), None)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.clients)

    @property
    def bytes_up(self) -> int:
        return sum(c.bytes_up for c in self.clients)

    @property
    def bytes_down(self) -> int:
        return sum(c.bytes_down for c in self.clients)

    @property
    def wait_s(self) -> float:
        return sum(c.wait_s for c in self.clients)

    # ---- calls ----------------------------------------------------------------------
    def stream_broadcasts(self) -> None:
        for c in self.clients:
            c.stream_broadcasts()

    def start(self, initial: np.ndarray) -> None:
        """Join every shard; each asks for the seed on its own (the same weights, their
        digest computed once)."""
        digest = seed_sha256(initial)
        for c in self.clients:
            c.start(initial, digest)

    def take(self) -> list[Received]:
        return [r for c in self.clients for r in c.take()]

    def wait(self, timeout: float | None, need_connection: bool = False) -> list[Received]:
        """Until any shard has a broadcast (or timeout / a fatal error / close): the
        shards' connections share one condition, which each notifies."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while True:
                got = self.take()
                if got or self.fatal or any(c.closed for c in self.clients):
                    return got
                if need_connection and not self.connected.is_set():
                    return []
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return []
                self.cond.wait(timeout=0.5 if left is None else min(left, 0.5))

    def wait_one(self, timeout: float | None) -> Received | None:
        got = self.wait(timeout)
        return max(got, key=lambda r: r.version) if got else None

    def push(self, payload: bytes | memoryview, *, encoding: str, base_version: int,
             loss_tokens: int, steps: int, seq: int, fragment: int = 0, numel: int | None = None,
             train_loss: float = float("nan"), eval_loss: float = float("nan")) -> Future:
        """Push to the shard that owns `fragment`."""
        return self._of(fragment).push(payload, encoding=encoding, base_version=base_version,
                                       loss_tokens=loss_tokens, steps=steps, seq=seq,
                                       fragment=fragment, numel=numel, train_loss=train_loss,
                                       eval_loss=eval_loss)

    def finish(self) -> None:
        for c in self.clients:
            c.finish()

    def close(self) -> None:
        for c in self.clients:
            c.close()
