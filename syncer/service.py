"""gRPC edge of the syncer: framing, auth, status codes. State lives in `Run`."""

from __future__ import annotations

import hmac
import ipaddress
import itertools
import logging
import socket
import threading
from concurrent import futures

import grpc
import numpy as np

from syncer.run import Broadcast, Reject, Run
from yeto import net
from yeto.io import host_port
from yeto.layout import TensorSpec
from yeto.proto import yeto_pb2 as pb
from yeto.proto import yeto_pb2_grpc as pb_grpc

log = logging.getLogger("syncer")

_CODES = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
}


def _abort(context, reject: Reject, run: Run | None = None, call: str = "",
           learner: str = ""):
    if run is not None:
        run.note_rejected(call, learner, reject)
    context.abort(_CODES[reject.code], str(reject))


class SyncerService(pb_grpc.SyncerServicer):
    def __init__(self, run: Run, max_inflight_pushes: int = 4):
        self.run = run
        self.inflight = threading.BoundedSemaphore(max_inflight_pushes)

    def Join(self, request, context):
        specs = [TensorSpec(t.name, tuple(int(d) for d in t.shape), t.dtype)
                 for t in request.layout]
        try:
            r = self.run.join(request.learner_id, specs, request.fingerprint, request.backend,
                              request.weights_file, dict(request.export_files))
        except Reject as e:
            _abort(context, e, self.run, "join", request.learner_id)
        return pb.JoinReply(**r)

    def Push(self, request_iterator, context):
        first = None
        try:
            first = next(request_iterator, None)
            if first is None or not first.HasField("header"):
                raise Reject("invalid", "a push must start with a header chunk")
            h = first.header
            if h.kind not in (pb.DELTA, pb.SEED):
                raise Reject("invalid", f"unknown push kind {h.kind}")
            size = self.run.check_push_header(h)
            # bounded: concurrent pushes each hold a payload buffer until merged
            with self.inflight:
                payload = _receive(first, request_iterator, size)
                return pb.PushReply(**self.run.push(h, payload))
        except Reject as e:
            _abort(context, e, self.run, "push", first.header.learner_id if first else "")

    def Subscribe(self, request, context):
        run = self.run
        try:
            with run.cond:
                run.check_island(request.learner_id, request.generation)
        except Reject as e:
            _abort(context, e)
        context.add_callback(lambda: run.island_gone(request.learner_id, request.generation))
        sub = Subscription(run, request.learner_id, request.generation)
        while context.is_active():
            try:
                bc = sub.wait_next(context.is_active)
            except Reject as e:  # superseded by a newer connection of the same island
                _abort(context, e)
            if bc is None or not context.is_active():
                return
            yield from sub.send(bc)
            if sub.all_finals_sent():
                run.mark_final_delivered(request.learner_id)
                return

    def Heartbeat(self, request, context):
        try:
            return pb.HeartbeatReply(**self.run.heartbeat(request.learner_id,
                                                          request.generation))
        except Reject as e:
            _abort(context, e)

    def Status(self, request, context):
        s = self.run.status()
        islands = [pb.IslandStatus(**i) for i in s.pop("islands")]
        return pb.StatusReply(islands=islands, **s)

    def Finish(self, request, context):
        try:
            return pb.FinishReply(run_finished=self.run.finish_island(request.learner_id,
                                                                     request.generation))
        except Reject as e:
            _abort(context, e)


class Subscription:
    """One island's broadcast stream: what it has been sent (the newest version per
    fragment, and which fragments' final weights), so it gets each new version once,
    as a compressed update when it holds the version that update is against."""

    def __init__(self, run: Run, learner_id: str, generation: int):
        self.run, self.learner_id, self.generation = run, learner_id, generation
        self.sent: dict[int, int] = {}
        self.sent_final: set[int] = set()

    def _pending(self) -> Broadcast | None:
        for f, bc in sorted(self.run.broadcasts.items()):
            if bc.version > self.sent.get(f, -1) or (bc.final and f not in self.sent_final):
                return bc
        return None

    def wait_next(self, active) -> Broadcast | None:
        """The next broadcast to send, waiting while `active()`; None when it ends.
        Raises Reject when this connection has been superseded."""
        run = self.run
        with run.cond:
            bc = self._pending()
            while active() and bc is None:
                run.cond.wait(timeout=1.0)
                bc = self._pending()
            if bc is not None:
                run.check_island(self.learner_id, self.generation)
            return bc

    def send(self, bc: Broadcast):
        """The chunks of one broadcast; records it as sent once they are all out."""
        run = self.run
        use_delta = bc.delta is not None and self.sent.get(bc.fragment) == bc.base_version
        payload = bc.delta if use_delta else bc.payload
        header = pb.BroadcastHeader(
            version=bc.version, round=bc.version, fragment=bc.fragment,
            encoding=run.cfg.downlink if use_delta else bc.encoding,
            numel=run.layout.fragments[bc.fragment].numel, payload_bytes=len(payload),
            final=bc.final, delta=use_delta, base_version=bc.base_version)
        for i, piece in enumerate(net.chunks(payload)):
            yield pb.BroadcastChunk(header=header if i == 0 else None, data=bytes(piece))
        with run.cond:
            run.bytes_out += len(payload)
        self.sent[bc.fragment] = bc.version
        if bc.final:
            self.sent_final.add(bc.fragment)

    def all_finals_sent(self) -> bool:
        return len(self.sent_final) == self.run.cfg.fragments


def _receive(first, rest, size: int) -> np.ndarray:
    """Assemble a push payload of exactly `size` bytes from its chunks."""
    payload = np.empty(size, np.uint8)  # numpy buffers avoid bytearray's page-fault cost
    n = 0
    for chunk in itertools.chain([first], rest):
        if chunk is not first and chunk.HasField("header"):
            raise Reject("invalid", "a push carries exactly one header")
        data = chunk.data  # each access copies: read once
        k = len(data)
        if n + k > size:
            raise Reject("invalid", f"push payload exceeds the {size} bytes its header announced")
        payload[n:n + k] = np.frombuffer(data, np.uint8)
        n += k
    if n != size:
        raise Reject("invalid", f"push payload ended after {n} of {size} bytes")
    return payload


class TokenAuth(grpc.ServerInterceptor):
    """Every call must carry `authorization: Bearer <token>` metadata."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, details):
        got = dict(details.invocation_metadata).get(net.AUTH_KEY, "")
        if hmac.compare_digest(got.encode(), self._expected):
            return continuation(details)
        handler = continuation(details)

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong token: pass the syncer's token with --token "
                          f"or the {net.TOKEN_ENV} environment variable")

        if handler is None:
            return None
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def serve(run: Run, host: str, port: int, token: str | None = None,
          tls: tuple[bytes, bytes, bytes | None] | None = None, max_workers: int = 64,
          max_inflight_pushes: int = 4):
    """Start the server; returns (server, bound port). A ticker thread commits
    rounds whose grace window or timeout has passed."""
    interceptors = [TokenAuth(token)] if token else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         interceptors=interceptors, options=net.GRPC_OPTIONS)
    pb_grpc.add_SyncerServicer_to_server(SyncerService(run, max_inflight_pushes), server)
    address = host_port(host, port)
    if tls:
        cert, key, ca = tls
        creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                            require_client_auth=ca is not None)
        bound = server.add_secure_port(address, creds)
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen on {address}: is the port in use? (try --port 0 for any "
                      "free port)")
    server.start()
    stop = threading.Event()

    def tick():
        while not stop.wait(0.05):
            run.tick()

    threading.Thread(target=tick, name="syncer-ticker", daemon=True).start()
    server.ticker_stop = stop
    return server, bound
