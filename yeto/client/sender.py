"""Pushes from the island to the syncer, in the background: each payload streamed in
zero-copy slices (`yeto.net.chunks`, one copy into each chunk's wire bytes), on one
thread, so a push overlaps training, pushes keep their order and Finish follows the
last of them. The seed goes the same way, from the caller's array."""

from __future__ import annotations

import hashlib
import logging
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import grpc
import numpy as np

from yeto import codec, net, wire
from yeto.client.connection import REFUSALS, Connection
from yeto.memory import trim
from yeto.proto import yeto_pb2 as pb
from yeto.transport import Lost, PushReply, Refused, Unavailable

log = logging.getLogger("yeto.client")


def seed_sha256(initial: np.ndarray) -> bytes:
    """The SHA-256 of the seed an island with these initial weights sends (f32, the
    layout's order): declared at join, so the run's first quorum can agree on Θ."""
    seed = np.ascontiguousarray(initial, dtype=np.float32)
    return hashlib.sha256(memoryview(seed).cast("B")).digest()


class PushSender:
    """Sends pushes, the seed and Finish over `link`. `executor`: where pushes run
    (default: one background thread; `yeto.sim` on simulated time runs them inline)."""

    def __init__(self, link: Connection, numel: int, executor: Executor | None = None):
        self.link, self.numel = link, numel
        self.executor = executor or ThreadPoolExecutor(1, thread_name_prefix="yeto-push")
        self.bytes_up = 0

    def seed(self, initial: np.ndarray) -> None:
        """Send the island's weights as the run's first Θ (the syncer asked for them)."""
        header = pb.PushHeader(learner_id=self.link.learner_id, generation=self.link.generation,
                               kind=pb.SEED, encoding="f32", numel=self.numel,
                               payload_bytes=4 * self.numel)
        seed = np.ascontiguousarray(initial, dtype=np.float32)
        codec.validate(memoryview(seed).cast("B"), "f32", seed.size)
        self._stream(header, memoryview(seed).cast("B"))  # zero-copy slices

    def push(self, payload: bytes | memoryview, *, encoding: str, base_version: int,
             loss_tokens: int, steps: int, seq: int, fragment: int = 0, numel: int | None = None,
             train_loss: float = float("nan"), eval_loss: float = float("nan")) -> Future:
        """Send one pseudo-gradient in the background; the future resolves to the
        syncer's `PushReply` or raises `Refused` / `Lost` / `Unavailable`. `payload` is
        sent in zero-copy slices: it must not change until the future is done."""
        link = self.link
        if not link.connected.is_set():
            f: Future = Future()
            f.set_exception(Unavailable(f"not connected to the syncer at {link.address}"))
            return f
        header = pb.PushHeader(
            learner_id=link.learner_id, generation=link.generation, round=base_version + 1,
            fragment=fragment, base_version=base_version, loss_tokens=loss_tokens, steps=steps,
            encoding=encoding, numel=self.numel if numel is None else numel,
            payload_bytes=len(payload), kind=pb.DELTA,
            seq=seq, train_loss=train_loss, eval_loss=eval_loss)
        return self.executor.submit(self._push_or_raise, header, payload)

    def _push_or_raise(self, header, payload) -> PushReply:
        try:
            return self._stream(header, payload)
        except grpc.RpcError as e:
            kind = Refused if e.code() in REFUSALS else Lost
            raise kind(f"{e.code().name}: {e.details()}") from e

    def _stream(self, header, payload) -> PushReply:
        def chunks():  # each chunk's wire bytes in one copy of its slice of the payload
            for i, piece in enumerate(net.chunks(payload, net.CHUNK_BYTES)):
                yield wire.chunk_bytes(header if i == 0 else None, piece)

        try:
            reply = self.link.push_call(chunks(), metadata=self.link.metadata, timeout=300)
        finally:
            trim()  # the chunks' messages, freed in gRPC's threads
        self.bytes_up += len(payload)
        return PushReply(reply.accepted, reply.status, reply.round, reply.staleness)

    def finish(self) -> None:
        """Tell the syncer this island trained its last step."""
        link = self.link
        if link.connected.is_set():
            request = pb.FinishRequest(learner_id=link.learner_id, generation=link.generation)
            try:  # through the sender thread: it must arrive after the last push
                self.executor.submit(link.stub.Finish, request, metadata=link.metadata,
                                     timeout=30).result()
            except grpc.RpcError as e:
                log.warning("finish not delivered (%s); the syncer will notice the island "
                            "leave", e.details())

    def close(self) -> None:
        """Wait for the pushes under way."""
        self.executor.shutdown(wait=True, cancel_futures=False)
