"""gRPC edge of the syncer: framing, auth, admission, status codes. State lives in `Run`.

Authentication (with a run secret): every call carries `authorization: Bearer <token>`
where the token is the caller's island credential (`yeto.net.island_credential`:
derived from the secret, so the syncer keeps no list), good for its own learner id
only, or the run's secret itself (the operator's: it can act for anyone). A call for
another island's id is refused (PERMISSION_DENIED) and written to the tape.

Under mutual TLS without a run secret the client certificate is the credential: it is
good for the learner ids it names, as its subject's CN or a subjectAltName, and for no
other (refused and taped the same way). With a secret, the token names the island and
the certificate only admits the machine."""

from __future__ import annotations

import contextlib
import hmac
import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent import futures
from typing import Any, NoReturn, Protocol, TypeAlias

import grpc
import numpy as np

from syncer import staging
from syncer.admission import UNARY_WORKERS, Exhausted, Streams, Watch
from syncer.broadcast import Outgoing, Subscription
from syncer.direct import DirectPort, DirectStream, Gone
from syncer.errors import Reject
from syncer.messages import PushHeader
from syncer.run import Run
from syncer.staging import Received
from yeto import codec, net, wire
from yeto.codec import buffers, receiver
from yeto.io import host_port
from yeto.layout import TensorSpec
from yeto.proto import yeto_pb2 as pb
from yeto.proto import yeto_pb2_grpc as pb_grpc

log = logging.getLogger("syncer")
# gRPC lets a second server bind a port in use (SO_REUSEPORT) unless told not to:
# then two syncers on one port would split the islands between two runs
EXCLUSIVE_PORT = [("grpc.so_reuseport", 0)]
# a delta push this large goes to a temporary file as it arrives (`_PushStream.buffer`)
SPILL_MIN_BYTES = 16 << 20
# a push moves at least this much payload in every --stream-idle-s (else it is cut off)
PROGRESS_BYTES = 64 << 10


def _abort(context: grpc.ServicerContext, reject: Reject, run: Run | None = None, call: str = "",
           learner: str = "") -> NoReturn:
    """Refuse the call; the tape gets it (`run` given) unless it failed authentication
    (an unauthenticated caller cannot fill the tape; `_caller` tapes impersonations)."""
    if run is not None and reject.code not in ("unauthenticated", "denied"):
        run.note_rejected(call, learner, reject)
    context.abort(reject.status, str(reject))


# (certificate, key, CA for client certificates or None) PEM bytes
TLSFiles: TypeAlias = tuple[bytes, bytes, bytes | None]


class SyncerServer(Protocol):
    """The gRPC server `serve` starts, with its ticker's stop event (set it on shutdown,
    then `stop` the server)."""

    ticker_stop: threading.Event
    direct: DirectPort | None  # the direct downlink's port (None: off)

    def stop(self, grace: float | None) -> threading.Event: ...

    def wait_for_termination(self, timeout: float | None = None) -> bool: ...


class SyncerService(pb_grpc.SyncerServicer):
    def __init__(self, run: Run, max_inflight_pushes: int = 4,
                 spill_min_bytes: int = SPILL_MIN_BYTES, secret: str | None = None,
                 streams: Streams | None = None, client_certs: bool = False):
        """`secret`: the run's secret (None: no authentication, for loopback runs).
        `streams`: the bounds on streaming calls (`syncer.admission`). `client_certs`:
        the server requires client certificates (mutual TLS): without a secret, a call
        may act only for an island its certificate names."""
        self.run, self.secret, self.client_certs = run, secret, client_certs
        self.streams = streams or Streams()
        self.inflight = threading.BoundedSemaphore(max_inflight_pushes)
        self.pool = buffers.buffer_pool(max_inflight_pushes)
        self.spills = buffers.spill_pool(max_inflight_pushes, run.cfg.state_dir)
        self.spill_min_bytes = spill_min_bytes
        self.arrivals = staging.Arrivals()
        self.direct_port = 0  # the direct downlink's port, once it listens (`offer_direct`)

    def _caller(self, context: grpc.ServicerContext, learner_id: str | None, call: str
                ) -> str | None:
        """Check a call's credential; returns the island it authenticates (None: no
        secret or client certificate is required, or the caller holds the run's secret
        and may act for anyone). Raises Reject for a missing or wrong credential, or
        one of another island."""
        if self.secret is None:
            return self._certified(context, learner_id, call) if self.client_certs else None
        got = dict(context.invocation_metadata() or ()).get(net.AUTH_KEY, "")
        # (only "-bin" keys carry bytes: a bytes authorization is no credential)
        return self._bearer(got if isinstance(got, str) else "", learner_id, call)

    def _bearer(self, authorization: str, learner_id: str | None, call: str) -> str | None:
        """`_caller` for an "authorization: Bearer <token>" value, under a run secret."""
        assert self.secret is not None
        token = authorization[len("Bearer "):] if authorization.startswith("Bearer ") else ""
        if token and hmac.compare_digest(token.encode(), self.secret.encode()):
            return None
        owner = net.credential_valid(self.secret, token) if token else None
        if owner is None:
            raise Reject("unauthenticated", "missing or wrong credential: pass this island's "
                         f"credential (or the run's token) with --token or ${net.TOKEN_ENV}")
        if learner_id is not None and owner != learner_id:
            e = Reject("denied", f"the credential of {owner!r} cannot act as {learner_id!r}")
            self.run.note_rejected(call, owner, e)
            raise e
        return owner

    def _operator(self, context: grpc.ServicerContext, call: str) -> None:
        """Calls only the run's secret may make (a standby syncer's)."""
        if self._caller(context, None, call) is not None or \
                (self.secret is None and self.client_certs):
            raise Reject("denied", f"{call} needs the run's secret (--token / "
                         f"${net.TOKEN_ENV}), not an island's credential")

    def _certified(self, context: grpc.ServicerContext, learner_id: str | None, call: str) -> str:
        """The island a call's client certificate (checked by the TLS handshake)
        speaks for: `learner_id` when the certificate names it, else Reject; with no id
        claimed (Status, a push before its header), the first name it holds."""
        # types-grpcio says Mapping[str, bytes]; gRPC gives each property a list of values
        names = _certificate_names(context.auth_context())  # type: ignore[arg-type]
        if not names:
            raise Reject("unauthenticated", "the client certificate names no island (no CN "
                         "or subjectAltName): give each island a certificate whose CN is "
                         "its learner id, e.g. openssl req -subj /CN=island-0 ...")
        if learner_id is not None and learner_id not in names:
            e = Reject("denied", f"the client certificate of {names[0]!r} cannot act as "
                       f"{learner_id!r}: under mutual TLS without a token an island's "
                       "certificate must name its learner id as its CN or a "
                       f"subjectAltName (e.g. openssl req -subj /CN={learner_id} ...)")
            self.run.note_rejected(call, names[0], e)
            raise e
        return learner_id if learner_id is not None else names[0]

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        specs = [TensorSpec(t.name, tuple(int(d) for d in t.shape), t.dtype)
                 for t in request.layout]
        try:
            self._caller(context, request.learner_id, "join")
            r = self.run.join(request.learner_id, specs, request.fingerprint, request.backend,
                              request.weights_file, dict(request.export_files),
                              observer=request.observer,
                              tokens_per_step=request.tokens_per_step,
                              regime=request.regime, sync_every=request.sync_every,
                              init_sha256=request.init_sha256,
                              known_term=request.known_term,
                              term_proof=request.term_proof)
        except Reject as e:
            _abort(context, e, self.run, "join", request.learner_id)
        return pb.JoinReply(**r, direct_port=self.direct_port)

    def offer_direct(self, port: int) -> None:
        """Join replies name the direct port (`syncer.direct`) from now on."""
        self.direct_port = port

    def Push(self, request_iterator: Iterator[wire.Chunk[pb.PushHeader]],
             context: grpc.ServicerContext) -> pb.PushReply:
        first, watch = None, None
        try:
            owner = self._caller(context, None, "push")
            with self.streams.admit(context, owner) as watch:
                first = next(request_iterator, None)
                watch.touch()
                if first is None or first.header is None:
                    raise Reject("invalid", "a push must start with a header chunk")
                try:
                    h = PushHeader.from_pb(first.header)
                except ValueError as e:
                    raise Reject("invalid", str(e)) from None
                if owner is not None and h.learner_id != owner:
                    self._caller(context, h.learner_id, "push")  # refused and taped
                body = _PushStream(self, first, request_iterator, watch)
                return pb.PushReply(**self.run.push(h, body))
        except Exhausted as e:
            _abort(context, Reject("exhausted", str(e)))
        except Reject as e:
            learner = first.header.learner_id if first and first.header else ""
            _abort(context, e, self.run, "push", learner)
        except grpc.RpcError:
            if watch is None or not watch.expired:
                raise
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the push sent nothing for "
                          f"{self.streams.idle_s:.0f} s (--stream-idle-s): cancelled")

    def spill_file(self, h: PushHeader) -> buffers.SpilledPayload:
        """A pooled spill file for push `h`'s bytes, in the state dir."""
        folder = self.run.cfg.state_dir
        try:
            return self.spills.get(h.payload_bytes)
        except OSError as e:
            raise Reject("exhausted", f"the syncer cannot open a spill file in "
                         f"{folder or 'the temporary folder'}: {e}; the island retries") from None

    def Subscribe(self, request: pb.SubscribeRequest,
                  context: grpc.ServicerContext) -> Iterator[bytes]:
        try:
            self._caller(context, request.learner_id, "subscribe")
            with self.streams.admit(context, request.learner_id, push=False):
                yield from self._subscribe(request, context)
        except Exhausted as e:
            _abort(context, Reject("exhausted", str(e)))
        except Reject as e:
            _abort(context, e)

    def _subscribe(self, request: pb.SubscribeRequest,
                   context: grpc.ServicerContext) -> Iterator[bytes]:
        run = self.run
        with run.cond:
            run.check_island(request.learner_id, request.generation)
        context.add_callback(lambda: run.island_gone(request.learner_id, request.generation))
        for sub, nxt in self._outgoing(request.learner_id, request.generation,
                                       context.is_active):
            yield from sub.send(nxt)

    def _outgoing(self, learner_id: str, generation: int, active: Callable[[], bool]
                  ) -> Iterator[tuple[Subscription, Outgoing]]:
        """Each broadcast an island's stream sends next, while `active()`, until it has
        every final weight (then the run hears it was delivered)."""
        sub = Subscription(self.run, learner_id, generation)
        try:
            while active() and not sub.all_finals_sent():
                nxt = sub.wait_next(active)  # Reject: superseded by a newer one
                if nxt is None:
                    return
                if not active():
                    nxt.release()
                    return
                yield sub, nxt
        finally:  # also when the island hangs up at the last chunk of its final weights
            if sub.all_finals_sent():
                self.run.mark_final_delivered(learner_id)

    def subscribe_direct(self, hello: pb.DirectHello, stream: DirectStream) -> None:
        """A broadcast stream on the direct port (`syncer.direct`): Subscribe's checks,
        bounds and broadcasts, each payload sent from the weights' own memory."""
        run = self.run
        try:
            if self.secret is not None:
                self._bearer(hello.authorization, hello.learner_id, "subscribe")
            if hello.run_id != run.run_id:
                raise Reject("precondition", f"this syncer serves run {run.run_id!r}, not "
                             f"{hello.run_id!r}: join it first")
            with self.streams.admit(stream, hello.learner_id, push=False):
                with run.cond:
                    run.check_island(hello.learner_id, hello.generation)
                try:
                    for sub, nxt in self._outgoing(hello.learner_id, hello.generation,
                                                   stream.still_there):
                        sub.send_to(nxt, stream)
                finally:
                    run.island_gone(hello.learner_id, hello.generation)
        except Exhausted as e:
            stream.fail(Reject("exhausted", str(e)))
        except Reject as e:
            stream.fail(e)
        except Gone:
            pass

    def Heartbeat(self, request: pb.HeartbeatRequest,
                  context: grpc.ServicerContext) -> pb.HeartbeatReply:
        try:
            self._caller(context, request.learner_id, "heartbeat")
            return pb.HeartbeatReply(**self.run.heartbeat(request.learner_id,
                                                          request.generation))
        except Reject as e:
            _abort(context, e)

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        try:
            self._caller(context, None, "status")
        except Reject as e:
            _abort(context, e)
        s = self.run.status()
        islands = [pb.IslandStatus(**i) for i in s.pop("islands")]
        return pb.StatusReply(islands=islands, **s)

    def Finish(self, request: pb.FinishRequest, context: grpc.ServicerContext) -> pb.FinishReply:
        try:
            self._caller(context, request.learner_id, "finish")
            return pb.FinishReply(run_finished=self.run.finish_island(request.learner_id,
                                                                     request.generation))
        except Reject as e:
            _abort(context, e)

    def RegisterStandby(self, request: pb.RegisterStandbyRequest, context: grpc.ServicerContext
                        ) -> pb.RegisterStandbyReply:
        try:
            self._operator(context, "register_standby")
            net.parse_address(request.address)  # host:port, or ValueError
            return pb.RegisterStandbyReply(**self.run.register_standby(request.address,
                                                                       request.version))
        except ValueError as e:
            _abort(context, Reject("invalid", f"standby address: {e}"))
        except Reject as e:
            _abort(context, e)

    def Replicate(self, request_iterator: Iterator[pb.ReplicateChunk], context: grpc.ServicerContext
                  ) -> pb.ReplicateReply:
        _abort(context, Reject("precondition", "this syncer is a primary: replicas go to a "
                               "standby (--standby-of)"))


def _certificate_names(auth: Mapping[str, Iterable[bytes | str]]) -> list[str]:
    """The names a verified client certificate holds (gRPC's auth context): its
    subject's CN, then its subjectAltNames, each once."""
    names = [*auth.get("x509_common_name", ()), *auth.get("x509_subject_alternative_name", ())]
    return list(dict.fromkeys(n.decode("utf-8", "replace") if isinstance(n, bytes) else n
                              for n in names))


def _touching(chunks: Iterable[wire.Chunk[pb.PushHeader]], watch: Watch
              ) -> Iterator[wire.Chunk[pb.PushHeader]]:
    """The chunks of a push, telling `watch` each time another PROGRESS_BYTES of payload
    arrived (it is cancelled when that takes longer than --stream-idle-s): a stream of
    empty chunks, or one that trickles a few bytes at a time, is cut off like a silent
    one; a push smaller than PROGRESS_BYTES arrives whole within --stream-idle-s."""
    moved = 0
    for chunk in chunks:
        moved += len(chunk.data)
        if moved >= PROGRESS_BYTES:
            watch.touch()
            moved = 0
        yield chunk


class _PushStream:
    """One push's stream as `Run.push` receives it (`syncer.staging.PushBody`): a slot
    of the `--max-inflight-pushes`, the buffer its bytes go to, and the bytes, validated
    as they arrive.

    Each push in flight holds its payload, compressed as it came (q4: 0.5625 B per
    parameter), until it is validated whole and merged. A large delta goes to a
    temporary file as it arrives (`buffers.SpilledPayload`: a push in flight costs a
    chunk of memory, not its size); a small one to a buffer. Both are pooled: back in
    their pool once merged, for the next push, unless the run keeps them. A seed's
    buffer becomes Θ."""

    def __init__(self, service: SyncerService, first: wire.Chunk[pb.PushHeader],
                 rest: Iterable[wire.Chunk[pb.PushHeader]], watch: Watch) -> None:
        self._service, self._first, self._watch = service, first, watch
        self._rest = _touching(rest, watch)

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """The wait for a slot is bounded (holders move or are cancelled within
        --stream-idle-s; a WAN push may take minutes, so ten times that)."""
        inflight = self._service.inflight
        if not inflight.acquire(timeout=10 * self._service.streams.idle_s):
            raise Reject("exhausted", "every push slot of the syncer stayed busy; the "
                         "island retries")
        try:
            self._watch.touch()
            yield
        finally:
            inflight.release()

    @contextlib.contextmanager
    def buffer(self, h: PushHeader, keep: bool
               ) -> Iterator[buffers.SpilledPayload | np.ndarray | None]:
        sv = self._service
        if not h.seed and h.payload_bytes >= sv.spill_min_bytes:
            spilled = sv.spill_file(h)
            try:
                yield spilled
            finally:
                if not keep:
                    sv.spills.put(spilled)
            return
        pooled = None if keep else sv.pool.get(h.payload_bytes)
        try:
            yield pooled
        finally:
            if pooled is not None:
                sv.pool.put(pooled)

    def arriving(self, h: PushHeader) -> contextlib.AbstractContextManager[bool]:
        return self._service.arrivals.arriving(h)

    def receive(self, h: PushHeader, into: staging.Into, max_abs: float) -> Received:
        try:
            return _receive(h, self._first, self._rest, into, max_abs)
        except OSError as e:  # the spill file: a full or vanished disk
            raise Reject("exhausted", f"the syncer could not write the push from "
                         f"{h.learner_id} to its spill file: {e}; free disk space in the "
                         "state dir (or raise --spill-min-mib); the island retries") from None


def _receive(h: PushHeader, first: wire.Chunk[pb.PushHeader],
             rest: Iterable[wire.Chunk[pb.PushHeader]],
             into: staging.Into = None, max_abs: float | None = None) -> Received:
    """Assemble a push payload from its chunks into `into` (or a new buffer), validated
    as it arrives (see `yeto.codec.receiver.PayloadReceiver`): one buffer of the wire size,
    every value finite and within `max_abs`."""
    try:
        rx = receiver.PayloadReceiver(h.encoding, h.numel, into, max_abs)
        for chunk in itertools.chain([first], rest):
            if chunk is not first and chunk.header is not None:
                raise Reject("invalid", "a push carries exactly one header")
            rx.add(chunk.data)
        return rx.finish()
    except codec.CodecError as e:
        raise Reject("invalid", f"push from {h.learner_id} rejected: {e}") from None
    except ValueError as e:
        raise Reject("invalid", f"push from {h.learner_id}: {e}") from None


def add_to_server(service: SyncerService, server: grpc.Server) -> None:
    """Register the service's methods; Push and Subscribe move their payloads through
    `yeto.wire` (the same bytes on the wire, fewer copies)."""
    unary = grpc.unary_unary_rpc_method_handler
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        "Join": unary(service.Join, pb.JoinRequest.FromString, pb.JoinReply.SerializeToString),
        "Push": grpc.stream_unary_rpc_method_handler(
            service.Push, wire.parse_push_chunk, pb.PushReply.SerializeToString),
        "Subscribe": grpc.unary_stream_rpc_method_handler(
            service.Subscribe, pb.SubscribeRequest.FromString, wire.passthrough),
        "Heartbeat": unary(service.Heartbeat, pb.HeartbeatRequest.FromString,
                           pb.HeartbeatReply.SerializeToString),
        "Status": unary(service.Status, pb.StatusRequest.FromString,
                        pb.StatusReply.SerializeToString),
        "Finish": unary(service.Finish, pb.FinishRequest.FromString,
                        pb.FinishReply.SerializeToString),
        "RegisterStandby": unary(service.RegisterStandby, pb.RegisterStandbyRequest.FromString,
                                 pb.RegisterStandbyReply.SerializeToString),
        "Replicate": grpc.stream_unary_rpc_method_handler(
            service.Replicate, pb.ReplicateChunk.FromString, pb.ReplicateReply.SerializeToString),
    }
    name = pb.DESCRIPTOR.services_by_name["Syncer"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))


class _Served:
    """A `SyncerServer`: the gRPC server and the direct port (`direct`, None when off),
    stopped together."""

    def __init__(self, server: grpc.Server, direct: DirectPort | None,
                 ticker_stop: threading.Event):
        self._server, self.direct, self.ticker_stop = server, direct, ticker_stop

    def stop(self, grace: float | None) -> threading.Event:
        if self.direct is not None:
            self.direct.stop(grace)
        return self._server.stop(grace)

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self._server.wait_for_termination(timeout)


def serve(run: Run, host: str, port: int, token: str | None = None,
          tls: TLSFiles | None = None,
          max_inflight_pushes: int = 4, spill_min_bytes: int = SPILL_MIN_BYTES,
          streams: Streams | None = None, direct_port: int | None = 0
          ) -> tuple[SyncerServer, int]:
    """Start the server; returns (server, bound port). The port is the syncer's alone
    (a second syncer on it fails here). A ticker thread commits rounds whose grace
    window or timeout has passed, and cancels silent pushes; if it dies, the run
    stops (`Run.fatal`). Served, the run steps Θ behind its broadcasts when it has no
    state dir (`syncer.stepping`). Without TLS the direct downlink listens on
    `direct_port` too (0: any free port; None: not at all; `syncer.direct`)."""
    streams = streams or Streams()
    run.overlap_steps()
    workers = streams.max_streams + UNARY_WORKERS  # unary calls always find a worker
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers),
                         options=net.SERVER_OPTIONS + EXCLUSIVE_PORT)
    service = SyncerService(run, max_inflight_pushes, spill_min_bytes, token, streams,
                            client_certs=bool(tls and tls[2] is not None))
    add_to_server(service, server)
    address = host_port(host, port)
    try:
        bound = listen(server, address, tls)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on {address}: the port is in use (another syncer?) or "
                      "the address is not this machine's; choose another --port (0: any "
                      "free port)")
    direct = None
    if tls is None and direct_port is not None:
        try:
            direct = DirectPort(service, host, direct_port)
        except OSError:
            server.stop(None)
            raise
        service.offer_direct(direct.port)
    server.start()
    stop = threading.Event()
    threading.Thread(target=_tick, args=(run, streams, stop), name="syncer-ticker",
                     daemon=True).start()
    return _Served(server, direct, stop), bound


def listen(server: grpc.Server, address: str, tls: TLSFiles | None) -> int:
    """Bind `server` to `address`, with TLS when given (client certificates required
    when it names a CA); returns the port (0: not bound)."""
    if not tls:
        return server.add_insecure_port(address)
    cert, key, ca = tls
    creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                        require_client_auth=ca is not None)
    return server.add_secure_port(address, creds)


def _tick(run: Run, streams: Streams, stop: threading.Event) -> None:
    try:
        while not stop.wait(0.05):
            run.tick()
            streams.reap()
    except BaseException as e:  # noqa: BLE001 - a dead ticker would stall the run silently
        log.critical("the syncer's ticker failed", exc_info=True)
        run.fail(f"the syncer's ticker failed: {e!r}")
