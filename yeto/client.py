"""gRPC client of the syncer, run on background threads.

The training loop never blocks on the network: joining (with exponential
backoff), seeding, and receiving broadcasts happen on a connection thread;
pushes go through a one-thread executor and return futures. The caller applies
received weights at a step boundary (see `yeto.island.Island`).

Memory: a push is sent from the caller's payload buffer in zero-copy slices; the
seed from the caller's array. A broadcast is reassembled whole (one fragment of
f32) unless the caller asked for streams (`stream_broadcasts()`, as the island
does): then a large f32 broadcast is handed over at once as a
`yeto.transport.ThetaStream` and its chunks are passed on as they arrive, so the
island applies them into the model without the fragment ever being held whole.
With a compressed downlink the syncer sends updates against the Θ the island
holds, so the client keeps that Θ (one f32 copy per fragment) to add them to.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from yeto import codec, net, wire
from yeto.codec.receiver import KeepNothing, PayloadReceiver
from yeto.io import host_port
from yeto.layout import Layout
from yeto.memory import trim
from yeto.proto import yeto_pb2 as pb
from yeto.proto import yeto_pb2_grpc as pb_grpc
from yeto.transport import Lost, PushReply, Received, Refused, ThetaStream, Unavailable

log = logging.getLogger("yeto.client")


@dataclass(frozen=True)
class TLSConfig:
    ca: bytes | None = None      # CA that signed the syncer's certificate
    cert: bytes | None = None    # client certificate (mutual TLS)
    key: bytes | None = None

    @classmethod
    def from_files(cls, ca=None, cert=None, key=None) -> TLSConfig | None:
        """TLS from PEM file paths (None when neither a CA nor a certificate is given)."""
        if not (ca or cert):
            return None
        return cls(*(Path(f).read_bytes() if f else None for f in (ca, cert, key)))


def connect(syncer: str | None, learner_id: str, layout: Layout, **options) -> SyncerClient | None:
    """The client of the syncer at `syncer` ('host:port'), or None for a single island
    (`syncer` None, '' or 'none'). `options` go to `SyncerClient`."""
    if syncer in (None, "", "none"):
        return None
    return SyncerClient(syncer, learner_id, layout, **options)


# broadcasts above this size are streamed to a caller that asked for streams
STREAM_MIN_BYTES = 8 << 20

# status codes after which the same call would be refused again
REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)


def open_channel(address: str, tls: TLSConfig | None = None,
                 keepalive_s: float = net.KEEPALIVE_S) -> grpc.Channel:
    target = host_port(*net.parse_address(address))
    options = net.client_options(keepalive_s)
    if tls is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key,
                                             certificate_chain=tls.cert)
        return grpc.secure_channel(target, creds, options=options)
    return grpc.insecure_channel(target, options=options)


class SyncerClient:
    """The gRPC implementation of `yeto.transport.Transport`."""

    def __init__(self, address: str, learner_id: str, layout: Layout, *, token: str | None = None,
                 backend: str = "numpy", weights_file: str = "weights.safetensors",
                 export_files: dict[str, str] | None = None, tls: TLSConfig | None = None,
                 backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 keepalive_s: float = net.KEEPALIVE_S, channel: grpc.Channel | None = None,
                 sender: Executor | None = None, tokens_per_step: int = 0):
        """`keepalive_s`: see `yeto.net.KEEPALIVE_S`. `channel`: a ready channel to use
        instead of opening one to `address` (`yeto.sim` passes an in-process one).
        `sender`: the executor pushes run on (default: one background thread, so a push
        overlaps training; `yeto.sim` on simulated time runs them inline).
        `token`: this island's credential, or the run's secret (its credential is then
        derived from it). `tokens_per_step`: the most loss tokens one step holds (batch
        × sequence length), declared at join: the syncer refuses pushes claiming more."""
        self.address, self.learner_id, self.layout = address, learner_id, layout
        self._metadata = net.auth_metadata(
            net.credential_for(net.token_from_env(token), learner_id))
        self._join_request = pb.JoinRequest(
            learner_id=learner_id, fingerprint=layout.fingerprint, backend=backend,
            tokens_per_step=max(0, int(tokens_per_step)),
            weights_file=weights_file, export_files=export_files or {},
            layout=[pb.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype)
                    for s in layout.specs])
        self._channel = channel if channel is not None else open_channel(address, tls,
                                                                          keepalive_s)
        self._stub = pb_grpc.SyncerStub(self._channel)
        # the streaming calls without protobuf copies of the payload (yeto.wire)
        self._push_call = self._channel.stream_unary(
            "/yeto.v1.Syncer/Push", request_serializer=wire.passthrough,
            response_deserializer=pb.PushReply.FromString)
        self._subscribe_call = self._channel.unary_stream(
            "/yeto.v1.Syncer/Subscribe", request_serializer=pb.SubscribeRequest.SerializeToString,
            response_deserializer=wire.parse_broadcast_chunk)
        self._backoff = (backoff_s, max_backoff_s)
        self._cond = threading.Condition()
        self._latest: dict[int, Received] = {}  # newest untaken broadcast per fragment
        self._theta_of: dict[int, tuple[int, np.ndarray]] = {}  # fragment -> (version, Θ slice)
        self._keep_theta = True   # keep each Θ for compressed updates (see stream_broadcasts)
        self._streams = False
        self.stream_min_bytes = STREAM_MIN_BYTES
        self.num_fragments = 1
        self._closed = False
        self._sender = sender or ThreadPoolExecutor(1, thread_name_prefix="yeto-push")
        self.generation = 0
        self.connected = threading.Event()
        self.acked_seq = -1           # newest push seq the syncer confirmed (from join)
        self.fatal: str | None = None  # a refusal that retrying cannot fix
        self.last_error: str | None = None  # the newest connection error, for messages
        self.finished = False          # the final broadcast arrived
        self.run_id = ""
        self.bytes_up = 0
        self.bytes_down = 0
        self.wait_s = 0.0

    def stream_broadcasts(self) -> None:
        """Hand large f32 broadcasts over as `ThetaStream`s, and keep no copy of Θ
        unless the syncer sends compressed updates (the join reply says so; a syncer
        older than that field is found out by its first update, and the client then
        rejoins once for the full weights)."""
        self._streams = True
        self._keep_theta = False

    # ---- connection thread ------------------------------------------------
    def start(self, initial: np.ndarray) -> None:
        """Connect in the background; `initial` seeds Θ if the syncer asks for it."""
        self._initial = initial
        self._thread = threading.Thread(target=self._connection_loop, daemon=True,
                                        name=f"yeto-client-{self.learner_id}")
        self._thread.start()

    def _connection_loop(self) -> None:
        delay = self._backoff[0]
        while not self._closed and not self.finished and self.fatal is None:
            try:
                self._join_and_listen()
                delay = self._backoff[0]
            except grpc.RpcError as e:
                self.connected.clear()
                if self._closed:
                    return
                self.last_error = f"{e.code().name}: {e.details()}"
                if e.code() in REFUSALS and self.generation == 0:
                    self._refused(e)
                    return
                # full jitter: islands do not retry in lockstep after a syncer restart
                wait = random.uniform(delay / 2, delay)
                log.warning("syncer %s unreachable (%s); retrying in %.1fs, training "
                            "continues locally", self.address, self.last_error, wait)
                if self._sleep(wait):
                    return
                delay = min(delay * 2, self._backoff[1])

    def _refused(self, e: grpc.RpcError) -> None:
        self.fatal = f"syncer at {self.address} refused {self.learner_id}: {e.details()}"
        log.error("%s", self.fatal)
        with self._cond:
            self._cond.notify_all()

    def _sleep(self, seconds: float) -> bool:
        with self._cond:
            self._cond.wait_for(lambda: self._closed, timeout=seconds)
            return self._closed

    def _join_and_listen(self) -> None:
        self._join()
        # every new connection asks for the current Θ (a rejoined island catches up)
        self._stream = self._subscribe_call(
            pb.SubscribeRequest(learner_id=self.learner_id, generation=self.generation),
            metadata=self._metadata)
        self._listen(self._stream)
        if not self.finished and not self._closed:
            raise _StreamEnded()

    def _join(self) -> None:
        reply = self._stub.Join(self._join_request, metadata=self._metadata, timeout=30)
        if reply.finished:
            log.info("syncer reports the run already finished")
        self.generation, self.run_id = reply.generation, reply.run_id
        self.num_fragments = max(1, reply.num_fragments)
        self.acked_seq = reply.last_seq
        downlink = reply.downlink  # empty from a syncer older than the field: learn later
        if self._streams and downlink:
            self._keep_theta = downlink != "f32"
        self.connected.set()
        log.info("joined syncer %s as %s (generation %d, %d/%d islands, version %d)",
                 self.address, self.learner_id, reply.generation, reply.joined, reply.quorum,
                 reply.version)
        if reply.send_seed:
            header = pb.PushHeader(learner_id=self.learner_id, generation=self.generation,
                                   kind=pb.SEED, encoding="f32", numel=self.layout.numel,
                                   payload_bytes=4 * self.layout.numel)
            seed = np.ascontiguousarray(self._initial, dtype=np.float32)
            codec.validate(memoryview(seed).cast("B"), "f32", seed.size)
            self._stream_push(header, memoryview(seed).cast("B"))  # zero-copy slices

    def _listen(self, stream) -> None:
        """Reassemble each broadcast from its chunks (or pass a stream on) and hand it
        over."""
        sink = None
        try:
            for chunk in stream:
                if chunk.HasField("header"):
                    if sink is not None:
                        raise _BadBroadcast("a broadcast header arrived inside a broadcast")
                    sink = self._sink(chunk.header)
                if sink is None:
                    raise _BadBroadcast("broadcast stream started without a header")
                if sink.add(chunk.data):  # a view into the received message
                    sink = None
        except BaseException as e:
            if sink is not None:
                sink.fail(str(e) or type(e).__name__)
            if isinstance(e, ValueError):  # CodecError too: reconnect, as for any broken
                raise _BadBroadcast(f"bad broadcast: {e}") from e  # broadcast, not end this thread
            raise

    def _sink(self, header):
        if (self._streams and not header.delta and header.encoding == "f32"
                and header.payload_bytes >= self.stream_min_bytes):
            return _Streamed(self, header)
        return _Buffered(self, header)

    def _deliver(self, header, buf: np.ndarray) -> None:
        if header.delta:  # an update to the version we hold: the same adds as the syncer
            current = self._theta_of.get(header.fragment)
            if current is None and not self._keep_theta:
                self._keep_theta = True
                raise _BadBroadcast("the syncer sends compressed updates: rejoining for the "
                                    "full weights (kept from now on to add updates to)")
            if current is None or current[0] != header.base_version:
                raise _BadBroadcast(f"broadcast update against version {header.base_version}, "
                                    f"but this island holds {current and current[0]}")
            theta = current[1].copy()
            codec.decode_add(buf, header.encoding, header.numel, theta, 1.0)
        elif header.encoding == "f32":  # validated as it arrived (_Buffered), used in place
            theta = buf.view(np.float32)
        else:
            theta = codec.decode(buf, header.encoding, header.numel)
        if self._keep_theta:
            self._theta_of[header.fragment] = (header.version, theta)
        self.bytes_down += len(buf)
        self._hand_over(Received(header.version, header.fragment, header.final, theta))

    def _hand_over(self, got: Received, done: bool | None = None) -> None:
        """Make `got` the newest broadcast of its fragment; `done`: the final weights are
        all in (default: `got.final`; a stream's are in when it ends)."""
        with self._cond:
            self._latest[got.fragment] = got
            self.finished = self.finished or (got.final if done is None else done)
            self._cond.notify_all()

    def _final_in(self) -> None:
        with self._cond:
            self.finished = True
            self._cond.notify_all()

    def _alive(self) -> bool:
        return not self._closed

    # ---- caller side ------------------------------------------------------
    def take(self) -> list[Received]:
        """The newest broadcast of each fragment not yet taken (maybe none)."""
        with self._cond:
            got, self._latest = list(self._latest.values()), {}
            return got

    def wait(self, timeout: float | None, need_connection: bool = False) -> list[Received]:
        """Block until a broadcast arrives (or timeout / fatal error / close)."""
        t0 = time.perf_counter()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._latest:
                if self._closed or self.fatal or (need_connection and not self.connected.is_set()):
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(timeout=0.5 if left is None else min(left, 0.5))
        self.wait_s += time.perf_counter() - t0
        return self.take()

    def wait_one(self, timeout: float | None) -> Received | None:
        """The newest broadcast (single-fragment runs), or None on timeout."""
        got = self.wait(timeout)
        return max(got, key=lambda r: r.version) if got else None

    def push(self, payload: bytes | memoryview, *, encoding: str, base_version: int,
             loss_tokens: int, steps: int, seq: int, fragment: int = 0, numel: int | None = None,
             train_loss: float = float("nan"), eval_loss: float = float("nan")) -> Future:
        """Send one pseudo-gradient in the background; the future resolves to the
        syncer's `PushReply` or raises `Refused` / `Lost` / `Unavailable`. `payload` is
        sent in zero-copy slices: it must not change until the future is done."""
        if not self.connected.is_set():
            f: Future = Future()
            f.set_exception(Unavailable(f"not connected to the syncer at {self.address}"))
            return f
        header = pb.PushHeader(
            learner_id=self.learner_id, generation=self.generation, round=base_version + 1,
            fragment=fragment, base_version=base_version, loss_tokens=loss_tokens, steps=steps,
            encoding=encoding, numel=self.layout.numel if numel is None else numel,
            payload_bytes=len(payload), kind=pb.DELTA,
            seq=seq, train_loss=train_loss, eval_loss=eval_loss)
        return self._sender.submit(self._push_or_raise, header, payload)

    def _push_or_raise(self, header, payload) -> PushReply:
        try:
            return self._stream_push(header, payload)
        except grpc.RpcError as e:
            kind = Refused if e.code() in REFUSALS else Lost
            raise kind(f"{e.code().name}: {e.details()}") from e

    def _stream_push(self, header, payload) -> PushReply:
        def chunks():  # each chunk's wire bytes in one copy of its slice of the payload
            for i, piece in enumerate(net.chunks(payload, net.CHUNK_BYTES)):
                yield wire.chunk_bytes(header if i == 0 else None, piece)

        try:
            reply = self._push_call(chunks(), metadata=self._metadata, timeout=300)
        finally:
            trim()  # the chunks' messages, freed in gRPC's threads
        self.bytes_up += len(payload)
        return PushReply(reply.accepted, reply.status, reply.round, reply.staleness)

    def finish(self) -> None:
        """Tell the syncer this island trained its last step."""
        if self.connected.is_set():
            request = pb.FinishRequest(learner_id=self.learner_id, generation=self.generation)
            try:  # through the sender thread: it must arrive after the last push
                self._sender.submit(self._stub.Finish, request, metadata=self._metadata,
                                    timeout=30).result()
            except grpc.RpcError as e:
                log.warning("finish not delivered (%s); the syncer will notice the island "
                            "leave", e.details())

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._sender.shutdown(wait=True, cancel_futures=False)
        stream = getattr(self, "_stream", None)
        if stream is not None:
            stream.cancel()
        self._channel.close()


def _receiver(header, keep: bool = True) -> PayloadReceiver:
    """The receiver of one broadcast, its size checked against its header; `keep`:
    into a buffer of its own, else the caller passes the values on as they arrive."""
    size = codec.encoded_size(header.encoding, header.numel)
    if header.payload_bytes != size:
        raise _BadBroadcast(f"{header.encoding} broadcast of {header.numel} values must be "
                            f"{size} bytes, header says {header.payload_bytes}")
    return PayloadReceiver(header.encoding, header.numel, None if keep else KeepNothing(size))


class _Buffered:
    """A broadcast reassembled whole, then handed over; checked as it arrives (values
    or q4 scales, `PayloadReceiver`), each piece while it is still in the cache."""

    def __init__(self, client: SyncerClient, header):
        self.client, self.header = client, header
        self.rx = _receiver(header)

    def add(self, data: memoryview) -> bool:
        self.rx.add(data)
        if not self.rx.complete:
            return False
        self.client._deliver(self.header, self.rx.finish())
        return True

    def fail(self, why: str) -> None:
        pass


class _Streamed:
    """A large f32 broadcast handed over at once as a `ThetaStream`; its values are
    checked (`PayloadReceiver`) and passed on as they arrive."""

    def __init__(self, client: SyncerClient, header):
        self.client, self.header = client, header
        self.rx = _receiver(header, keep=False)
        self.stream = ThetaStream(header.numel)
        self.dropped = False
        client._hand_over(Received(header.version, header.fragment, header.final, self.stream),
                          done=False)

    def add(self, data: memoryview) -> bool:
        piece = np.frombuffer(self.rx.add(data), np.float32)  # a CodecError: reconnect
        if piece.size and not self.dropped:
            self.dropped = not self.stream.put(piece, self.client._alive)
        if not self.rx.complete:
            return False
        self.stream.end()
        trim()  # the chunks' messages, freed here and in the island's thread
        self.client.bytes_down += self.rx.n
        if self.header.final:
            self.client._final_in()
        return True

    def fail(self, why: str) -> None:
        self.stream.fail(why)


class _StreamEnded(grpc.RpcError):
    """The broadcast stream ended before the run did: reconnect."""

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "broadcast stream ended"


class _BadBroadcast(grpc.RpcError):
    """A malformed broadcast: drop the connection and rejoin (the syncer re-sends Θ)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def code(self):
        return grpc.StatusCode.DATA_LOSS

    def details(self):
        return self.message


def status(address: str, token: str | None = None, tls: TLSConfig | None = None,
           timeout: float = 10) -> dict:
    """One Status call (for `yeto status` and tests)."""
    from google.protobuf.json_format import MessageToDict

    with open_channel(address, tls) as ch:
        reply = pb_grpc.SyncerStub(ch).Status(pb.StatusRequest(),
                                              metadata=net.auth_metadata(
                                                  net.token_from_env(token)), timeout=timeout)
    return MessageToDict(reply, preserving_proto_field_name=True,
                         always_print_fields_with_no_presence=True)
