"""An in-process transport: the real gRPC client code over the real syncer service,
without sockets.

`LocalChannel` stands where `yeto.client.SyncerClient`'s gRPC channel stands: its
calls serialize each message as the client does, hand it to the handlers the syncer's
`SyncerService` registers for a real server, and parse the replies as the client
does, with a `LocalContext` for what a gRPC context does there (abort with a status
code, liveness, end-of-call callbacks). `LocalClient` is a `SyncerClient` on it.
Everything above the channel — joins, seeding, chunked pushes, broadcasts,
reconnects, typed errors — and everything below
it — validation, merge, outer step, state, tape — is the code a real run executes.
"""

from __future__ import annotations

import threading

import grpc

from syncer.service import add_to_server
from yeto.client import SyncerClient
from yeto.client.direct import StatusError
from yeto.island.encoder import Inline


class LocalContext:
    """The parts of `grpc.ServicerContext` the syncer service uses."""

    def __init__(self):
        self._active = threading.Event()
        self._active.set()
        self._callbacks: list = []

    def abort(self, code: grpc.StatusCode, details: str):
        raise StatusError(code, details)

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
        except Exception as e:  # noqa: BLE001 - as a server reports it
            raise _as_rpc_error(e) from e
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


def _as_rpc_error(e: Exception) -> grpc.RpcError:
    """What a real server turns a handler's exception into."""
    if isinstance(e, grpc.RpcError):
        return e
    return StatusError(grpc.StatusCode.UNKNOWN, f"{type(e).__name__}: {e}")


class LocalChannel:
    """The `grpc.Channel` calls the client makes, served by a `SyncerService` in this
    process through the handlers it registers for a real server: every message is
    serialized and parsed as on the wire; only the socket is missing."""

    def __init__(self, service):
        registry = _Registry()
        add_to_server(service, registry)
        self._handler = registry.handlers[0]

    def _method(self, path: str):
        return self._handler.service(_CallDetails(path))

    def unary_unary(self, path, request_serializer=None, response_deserializer=None, **_):
        return self._caller(path, request_serializer, response_deserializer, stream_in=False)

    def stream_unary(self, path, request_serializer=None, response_deserializer=None, **_):
        return self._caller(path, request_serializer, response_deserializer, stream_in=True)

    def _caller(self, path, serialize, parse, stream_in: bool):
        def call(request, metadata=(), timeout=None, **_):
            h, context = self._method(path), LocalContext()
            try:
                if stream_in:
                    arg = (h.request_deserializer(serialize(m)) for m in request)
                    reply = h.stream_unary(arg, context)
                else:
                    reply = h.unary_unary(h.request_deserializer(serialize(request)), context)
                return parse(h.response_serializer(reply))
            except Exception as e:  # noqa: BLE001 - as a server reports it
                raise _as_rpc_error(e) from e
            finally:
                context.end()
        return call

    def unary_stream(self, path, request_serializer=None, response_deserializer=None, **_):
        def call(request, metadata=(), timeout=None, **_):
            h, context = self._method(path), LocalContext()
            arg = h.request_deserializer(request_serializer(request))
            replies = (response_deserializer(h.response_serializer(m))
                       for m in h.unary_stream(arg, context))
            return _Stream(replies, context)
        return call

    def close(self) -> None:
        pass


class LocalClient(SyncerClient):
    """A `SyncerClient` whose calls go to an in-process syncer service. On simulated
    time (a `yeto.sim.clock.VirtualClock`) its island steps aside while it waits."""

    def __init__(self, service, learner_id: str, layout, clock=None, **options):
        options.setdefault("backoff_s", 0.05)
        options.setdefault("max_backoff_s", 0.5)
        # on simulated time a push lands at once, at the island's simulated time
        super().__init__("in-process", learner_id, layout, channel=LocalChannel(service),
                         sender=Inline() if clock is not None else None, **options)
        self.clock = clock
        if clock is not None:
            self.receiver.on_hand_over = self._delivered

    def _delivered(self, got) -> None:
        self.clock.delivered(self.learner_id, got.fragment, got.version)

    def wait(self, timeout: float | None, need_connection: bool = False):
        if self.clock is None:
            return super().wait(timeout, need_connection)
        got = super().wait(0, need_connection)  # here already: no wait, no stepping aside
        if got:  # (stepping aside, the island would resume at a fleet time moved on by
            return got  # an island that resumed first, as if it had waited)
        with self.clock.waiting():
            return super().wait(timeout, need_connection)
