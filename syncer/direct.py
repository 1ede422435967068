"""The syncer's direct port: broadcasts over plain TCP, sent from Θ's memory.

The protocol is `yeto.wire`'s ("the direct downlink"). `DirectPort` listens beside
the gRPC server (same host, `--direct-port`; not under TLS), reads each connection's
hello within `HELLO_S`, and hands it to the service (`SyncerService.subscribe_direct`:
the same credential check, stream bounds and broadcasts as Subscribe) with a
`DirectStream` to write to. A stream writes with non-blocking sends only, so the
weights are pinned for one copy into the kernel at a time (`broadcast.Source.stream_to`)
and a stalled reader holds nothing but its own thread; the peers' TCP keepalive ends
the connection of one that vanished.
"""

from __future__ import annotations

import errno
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

from syncer.errors import Reject
from yeto import net, wire
from yeto.proto import yeto_pb2 as pb

log = logging.getLogger("syncer")
_SHORT_OF = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class Gone(ConnectionError):
    """The island closed its direct connection, or it broke."""


class DirectStream:
    """One island's direct connection, after its hello: non-blocking writes, whether
    the island is still there (it sends nothing after its hello), and a ping when
    the stream has been silent for half the hello's keepalive (`still_there`). A
    reader that stops reading holds this stream's thread and one of its island's
    stream slots (`Streams.per_island`), as a stalled gRPC stream holds a worker."""

    WAKE_S = 1.0  # a wait for the peer looks again this often (a retired source, a close)

    def __init__(self, sock: socket.socket, keepalive_s: float = net.KEEPALIVE_S):
        """`keepalive_s`: the island's (its hello's); it gives up after twice that
        without a byte, so a silent stream is pinged every half of it."""
        self._sock = sock
        sock.setblocking(False)
        self._closed = False
        self._owed = 0  # payload bytes the last header announced and not yet sent
        self._ping_s = min(max(keepalive_s, 1.0), 3600.0) / 2
        self._last_sent = time.monotonic()

    def active(self) -> bool:
        """The island has not hung up (nor sent anything: that is not the protocol)."""
        return not self._closed and not _poll(self._sock, select.POLLIN, 0)

    def still_there(self) -> bool:
        """`active`, and a one-byte ping sent when nothing went out for half the
        keepalive and the socket takes it at once (it never waits: called under the run's lock
        while the stream waits for a broadcast)."""
        if not self.active():
            return False
        if not self._owed and time.monotonic() - self._last_sent >= self._ping_s:
            try:
                if self._sock.send(bytes([wire.FRAME_PING])):
                    self._last_sent = time.monotonic()
            except OSError:  # full (the island still has bytes to read), or gone
                pass
        return True

    def send_header(self, header: pb.BroadcastHeader) -> None:
        if self._owed:
            raise RuntimeError(f"a broadcast header with {self._owed} bytes of the last "
                               "payload unsent")
        self._send_frame(wire.direct_frame(wire.FRAME_HEADER, header))
        self._owed = header.payload_bytes

    def send_some(self, view: memoryview) -> int:
        if len(view) > self._owed:
            raise RuntimeError(f"{len(view)} payload bytes where the header announced "
                               f"{self._owed} more")
        sent = self._send(view)
        self._owed -= sent
        return sent

    def _send(self, view: memoryview) -> int:
        try:
            sent = self._sock.send(view)
        except BlockingIOError:
            return 0
        except OSError as e:
            raise Gone(str(e)) from None
        self._last_sent = time.monotonic()
        return sent

    def _send_frame(self, frame: bytes) -> None:
        self._send_whole(memoryview(frame), self._send)

    def wait_writable(self) -> None:
        if not self.active():
            raise Gone("the island closed its direct connection")
        _poll(self._sock, select.POLLOUT, self.WAKE_S)

    def send_all(self, data: bytes | memoryview) -> None:
        self._send_whole(memoryview(data).cast("B"), self.send_some)

    def _send_whole(self, view: memoryview, send: Callable[[memoryview], int]) -> None:
        """All of `view` by `send` (a frame's bytes, or payload counted against the
        header), waiting (bounded, `wait_writable`) while the peer catches up."""
        while len(view):
            n = send(view)
            view = view[n:]
            if not n:
                self.wait_writable()

    def cancel(self) -> None:
        """End the stream from any thread: its next send or wait raises Gone."""
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def fail(self, reject: Reject) -> None:
        """Tell the island why its stream ends (as gRPC would: a status) when it is
        between broadcasts and its socket takes the frame now; mid-broadcast the
        connection just closes (the island rejoins). Its own thread closes it after."""
        if self._owed:
            return
        frame = wire.direct_frame(wire.FRAME_ERROR, pb.DirectError(
            code=reject.status.name, message=str(reject)))
        try:
            self._sock.send(frame)
        except OSError:
            pass

    def close(self) -> None:
        """The stream's own thread, once it is done with it."""
        self.cancel()
        self._sock.close()


def _poll(sock: socket.socket, events: int, timeout_s: float) -> bool:
    """Whether `sock` has any of `events` within `timeout_s` (a closed or broken socket
    has: the next call on it says what). `poll`, not `select`: a syncer with a
    thousand islands has descriptors past select's 1024."""
    if sock.fileno() < 0:
        return True
    p = select.poll()
    p.register(sock, events)
    return bool(p.poll(timeout_s * 1000))


class Subscriber(Protocol):
    def subscribe_direct(self, hello: pb.DirectHello, stream: DirectStream) -> None: ...


class DirectPort:
    """The listening socket and a thread per connection. `stop` closes it and ends
    every stream."""

    HELLO_S = 10.0  # a connection says who it is within this, or is closed
    MAX_WAITING = 64  # connections not yet past their hello; more are closed at once

    def __init__(self, service: Subscriber, host: str, port: int = 0):
        self._service = service
        try:
            self._listener = socket.create_server(
                (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                backlog=128)
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port} for the direct downlink: {e}; "
                          "choose another --direct-port (0: any free port), or "
                          "--no-direct") from None
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._waiting = 0
        self._open: set[DirectStream] = set()
        self._stopped = False
        self._thread = threading.Thread(target=self._accept, name="syncer-direct",
                                        daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError as e:
                if self._stopped:
                    return
                if e.errno not in _SHORT_OF:
                    raise
                log.warning("direct port: cannot accept a connection now (%s)", e)
                time.sleep(0.1)  # short of descriptors or memory: the others finish first
                continue
            with self._lock:
                if self._waiting >= self.MAX_WAITING or self._stopped:
                    sock.close()
                    continue
                self._waiting += 1
            threading.Thread(target=self._serve, args=(sock,), name="syncer-direct-stream",
                             daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            hello = wire.read_hello(sock, time.monotonic() + self.HELLO_S)
        except (OSError, ValueError) as e:
            log.info("direct port: a connection closed before a valid hello (%s)", e)
            sock.close()
            return
        finally:
            with self._lock:
                self._waiting -= 1
        net.keep_alive(sock, net.SERVER_KEEPALIVE_S)
        stream = DirectStream(sock, hello.keepalive_s or net.KEEPALIVE_S)
        with self._lock:
            if self._stopped:
                stream.close()
                return
            self._open.add(stream)
        try:
            self._service.subscribe_direct(hello, stream)
        except Exception:  # a bug serving one stream ends that stream, as gRPC's server does
            log.exception("direct port: the stream of %r failed", hello.learner_id)
        finally:
            with self._lock:
                self._open.discard(stream)
            stream.close()

    def stop(self, grace: float | None = None) -> None:
        """Take no more connections; end every stream now, or after `grace` seconds
        those still sending (as gRPC's server stops)."""
        with self._lock:
            self._stopped = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        self._listener.close()
        if grace:
            timer = threading.Timer(grace, self._cancel_all)
            timer.daemon = True
            timer.start()
        else:
            self._cancel_all()

    def _cancel_all(self) -> None:
        with self._lock:
            streams = list(self._open)
        for s in streams:
            s.cancel()
