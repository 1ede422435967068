"""An in-process transport: the real gRPC client code over the real syncer service,
without sockets.

`LocalStub` stands where `yeto.client.SyncerClient`'s gRPC stub stands and calls the
syncer's `SyncerService` methods directly, with a `LocalContext` for what a gRPC
context does there (abort with a status code, liveness, end-of-call callbacks).
`LocalClient` is a `SyncerClient` on such a stub. Everything above the stub — joins,
seeding, chunked pushes, broadcasts, reconnects, typed errors — and everything below
it — validation, merge, outer step, state, tape — is the code a real run executes.
"""

from __future__ import annotations

import threading

import grpc

from syncer.service import add_to_server
from yeto.client import SyncerClient
from yeto.proto import yeto_pb2 as pb


class LocalRpcError(grpc.RpcError):
    """What `context.abort` raises here, shaped like the error a gRPC call raises."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class LocalContext:
    """The parts of `grpc.ServicerContext` the syncer service uses."""

    def __init__(self):
        self._active = threading.Event()
        self._active.set()
        self._callbacks: list = []

    def abort(self, code: grpc.StatusCode, details: str):
        raise LocalRpcError(code, details)

    def is_active(self) -> bool:
        return self._active.is_set()

    def add_callback(self, fn) -> bool:
        self._callbacks.append(fn)
        return True

    def end(self) -> None:
        """The call is over (finished, cancelled or failed): run its callbacks once."""
        if self._active.is_set():
            self._active.clear()
            for fn in self._callbacks:
                fn()

    def invocation_metadata(self):
        return ()


class _Stream:
    """A server-streaming call's iterator, with the `cancel()` a gRPC call has."""

    def __init__(self, generator, context: LocalContext):
        self._gen, self._context = generator, context

    def __iter__(self):
        try:
            yield from self._gen
        finally:
            self._context.end()

    def cancel(self) -> None:
        self._context.end()


class _Registry:
    """Stands in for a `grpc.Server` while the service registers its handlers."""

    def add_generic_rpc_handlers(self, handlers) -> None:
        self.handlers = handlers


class _CallDetails:
    def __init__(self, method: str):
        self.method, self.invocation_metadata = method, ()


REPLIES = {"Join": pb.JoinReply, "Push": pb.PushReply, "Subscribe": pb.BroadcastChunk,
           "Heartbeat": pb.HeartbeatReply, "Status": pb.StatusReply, "Finish": pb.FinishReply}


class LocalStub:
    """`SyncerStub`'s calls on a `syncer.service.SyncerService` in this process,
    through the handlers the service registers for a real server: every message
    is serialized and parsed as on the wire, only the socket is missing."""

    def __init__(self, service):
        registry = _Registry()
        add_to_server(service, registry)
        self._handler = registry.handlers[0]
        self._prefix = "/" + pb.DESCRIPTOR.services_by_name["Syncer"].full_name + "/"

    def _call(self, name: str, request, context: LocalContext):
        h = self._handler.service(_CallDetails(self._prefix + name))
        parse = REPLIES[name].FromString
        if name == "Push":  # client streaming
            chunks = (h.request_deserializer(c.SerializeToString()) for c in request)
            return parse(h.response_serializer(h.stream_unary(chunks, context)))
        arg = h.request_deserializer(request.SerializeToString())
        if name == "Subscribe":  # server streaming
            return (parse(h.response_serializer(m)) for m in h.unary_stream(arg, context))
        return parse(h.response_serializer(h.unary_unary(arg, context)))

    def _unary(self, name: str, request):
        context = LocalContext()
        try:
            return self._call(name, request, context)
        finally:
            context.end()

    def Join(self, request, metadata=(), timeout=None):
        return self._unary("Join", request)

    def Push(self, chunks, metadata=(), timeout=None):
        return self._unary("Push", chunks)

    def Finish(self, request, metadata=(), timeout=None):
        return self._unary("Finish", request)

    def Status(self, request, metadata=(), timeout=None):
        return self._unary("Status", request)

    def Heartbeat(self, request, metadata=(), timeout=None):
        return self._unary("Heartbeat", request)

    def Subscribe(self, request, metadata=()):
        context = LocalContext()
        return _Stream(self._call("Subscribe", request, context), context)


class LocalClient(SyncerClient):
    """A `SyncerClient` whose calls go to an in-process syncer service."""

    def __init__(self, service, learner_id: str, layout, **options):
        options.setdefault("backoff_s", 0.05)
        options.setdefault("max_backoff_s", 0.5)
        super().__init__("in-process", learner_id, layout, **options)
        self._stub = LocalStub(service)
