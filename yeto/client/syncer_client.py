"""`SyncerClient`: the gRPC implementation of `yeto.transport.Transport`, over a
connection (join, backoff, rejoin), a broadcast receiver and a push sender.

The training loop never blocks on the network: joining, seeding and receiving
broadcasts happen on the connection's thread; pushes go through the sender's thread
and return futures. The caller applies received weights at a step boundary (see
`yeto.island.Island`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future

import grpc
import numpy as np

from yeto import net
from yeto.client.connection import Connection, StreamEnded, TLSConfig, join_request
from yeto.client.receiver import BroadcastReceiver
from yeto.client.sender import PushSender, seed_sha256
from yeto.layout import Layout
from yeto.proto import yeto_pb2 as pb
from yeto.transport import Received, Transport


class SyncerClient(Transport):
    """The gRPC implementation of `yeto.transport.Transport`: `connection` (what the
    last join said), `receiver` (broadcasts in), `sender` (pushes out)."""

    def __init__(self, address: str, learner_id: str, layout: Layout, *, token: str | None = None,
                 backend: str = "numpy", weights_file: str = "weights.safetensors",
                 export_files: dict[str, str] | None = None, tls: TLSConfig | None = None,
                 backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 keepalive_s: float = net.KEEPALIVE_S, channel: grpc.Channel | None = None,
                 sender: Executor | None = None, tokens_per_step: int = 0,
                 regime: str = "sft", sync_every: int = 0, shard: int | None = None,
                 check_join: Callable[[pb.JoinReply], str | None] | None = None,
                 cond: threading.Condition | None = None):
        """`keepalive_s`: see `yeto.net.KEEPALIVE_S`. `channel`: a ready channel to use
        instead of opening one to `address` (`yeto.sim` passes an in-process one).
        `sender`: the executor pushes run on (default: one background thread, so a push
        overlaps training; `yeto.sim` on simulated time runs them inline).
        `token`: this island's credential, or the run's secret (its credential is then
        derived from it). `tokens_per_step`: the most loss tokens one step holds (batch
        × sequence length), declared at join: the syncer refuses pushes claiming more.
        `regime`: what the island trains, "sft" or "rl" (declared at join: the syncer's
        default outer rule, `--outer auto`, is plain averaging once an "rl" island joins).
        `sync_every`: its steps between pushes of a fragment, declared at join (0: it
        pushes by time): the syncer refuses pushes claiming more steps than that allows.
        `shard`: the shard of a sharded run this client talks to (None: an unsharded
        run); `check_join(reply)`: what is wrong with a join reply (None: nothing), to
        end the island's part in the run with that message. `cond`: see `Connection`."""
        self.address, self.learner_id, self.layout = address, learner_id, layout
        self.shard, self.check_join = shard, check_join
        request = join_request(learner_id, layout, backend, weights_file, export_files,
                               tokens_per_step, regime, sync_every)
        self.connection = Connection(address, learner_id, request, token=token, tls=tls,
                                     backoff_s=backoff_s, max_backoff_s=max_backoff_s,
                                     keepalive_s=keepalive_s, channel=channel, cond=cond)
        self.receiver = BroadcastReceiver(self.connection)
        self.sender = PushSender(self.connection, layout.numel, sender)
        # pushes go out on the sender's own thread (not `sender`'s, e.g. yeto.sim's
        # inline one): the island then encodes them in the background too
        self.background_pushes = sender is None

    # ---- what the transport keeps up to date (yeto.transport.Transport) ----
    @property
    def connected(self) -> threading.Event:
        return self.connection.connected

    @property
    def generation(self) -> int:
        return self.connection.generation

    @property
    def run_id(self) -> str:
        return self.connection.run_id

    @property
    def num_fragments(self) -> int:
        return self.connection.num_fragments

    @property
    def acked_seq(self) -> int:
        return self.connection.acked_seq

    @property
    def fatal(self) -> str | None:
        return self.connection.fatal

    @property
    def last_error(self) -> str | None:
        return self.connection.last_error

    @property
    def finished(self) -> bool:
        return self.receiver.finished

    @property
    def bytes_up(self) -> int:
        return self.sender.bytes_up

    @property
    def bytes_down(self) -> int:
        return self.receiver.bytes_down

    @property
    def wait_s(self) -> float:
        return self.receiver.wait_s

    def generation_for(self, fragment: int) -> int:
        return self.connection.generation

    def acked_seq_for(self, fragment: int) -> int:
        return self.connection.acked_seq

    # ---- calls ------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """No more joins: the island stopped its connection."""
        return self.connection.closed

    def stream_broadcasts(self) -> None:
        """Hand large f32 broadcasts over as `ThetaStream`s (`BroadcastReceiver`)."""
        self.receiver.stream_broadcasts()

    def start(self, initial: np.ndarray, digest: bytes | None = None) -> None:
        """Connect in the background; `initial` seeds Θ if the syncer asks for it (its
        digest, `seed_sha256(initial)` unless given, is declared at join)."""
        self._initial = initial
        self.connection.join_request.init_sha256 = digest or seed_sha256(initial)
        self.connection.start(self._session, lambda: self.receiver.finished)

    def _session(self, reply: pb.JoinReply) -> None:
        """After each join: the seed if asked for, then broadcasts until the stream ends."""
        wrong = self._wrong_shard(reply) or (self.check_join and self.check_join(reply))
        if wrong:
            self.connection.give_up(wrong)
            return
        self.receiver.joined(reply.downlink)
        if reply.send_seed:
            self.sender.seed(self._initial)
        self.receiver.listen(self.connection.subscribe())
        if not self.receiver.finished and not self.connection.closed:
            raise StreamEnded()

    def _wrong_shard(self, reply: pb.JoinReply) -> str | None:
        shards = max(1, reply.shards)
        if self.shard is None and shards > 1:
            return (f"the syncer at {self.address} is shard {reply.shard} of {shards}: list "
                    "every shard's address in order, separated by ';' (--syncer 'A;B')")
        if self.shard is not None and reply.shard != self.shard:
            return (f"wrong shard map: the address at position {self.shard} of --syncer, "
                    f"{self.address}, is shard {reply.shard} of {shards}; list the shards in "
                    "order (--shard 0/S first)")
        return None

    def take(self) -> list[Received]:
        """The newest broadcast of each fragment not yet taken (maybe none)."""
        return self.receiver.take()

    def wait(self, timeout: float | None, need_connection: bool = False) -> list[Received]:
        """Block until a broadcast arrives (or timeout / fatal error / close)."""
        return self.receiver.wait(timeout, need_connection)

    def wait_one(self, timeout: float | None) -> Received | None:
        """The newest broadcast (single-fragment runs), or None on timeout."""
        got = self.wait(timeout)
        return max(got, key=lambda r: r.version) if got else None

    def push(self, payload: bytes | memoryview, *, encoding: str, base_version: int,
             loss_tokens: int, steps: int, seq: int, fragment: int = 0, numel: int | None = None,
             train_loss: float = float("nan"), eval_loss: float = float("nan")) -> Future:
        """Send one pseudo-gradient in the background; the future resolves to the
        syncer's `PushReply` or raises `Refused` / `Lost` / `Unavailable` (see
        `PushSender.push`)."""
        return self.sender.push(payload, encoding=encoding, base_version=base_version,
                                loss_tokens=loss_tokens, steps=steps, seq=seq, fragment=fragment,
                                numel=numel, train_loss=train_loss, eval_loss=eval_loss)

    def finish(self) -> None:
        """Tell the syncer this island trained its last step."""
        self.sender.finish()

    def close(self) -> None:
        self.connection.stop()
        self.sender.close()
        self.connection.close()
