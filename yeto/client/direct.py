"""The island's end of the direct downlink (`yeto.wire`): its broadcasts read from the
syncer's direct port straight into fresh buffers, as the chunks `BroadcastReceiver.listen`
takes from Subscribe (a header on the first, a view of the bytes on each), so everything
after the socket (checks, decoding, streamed apply) is the same code."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from yeto import net, wire
from yeto.proto import yeto_pb2 as pb

CONNECT_S = 5.0  # a direct port that does not answer within this is taken as unreachable


class StatusError(grpc.RpcError):
    """A gRPC status raised without a gRPC call, shaped like the error a call raises
    (`code()`, `details()`): a direct stream that ended early (UNAVAILABLE for a broken
    connection), or an in-process call of `yeto.sim`. The island's connection handles
    it as it handles a call's."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self._code, self._details = code, message

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class NotDirect(StatusError):
    """The port answered, but not as a syncer's direct port (another service behind a
    forwarded or tunnelled address): the island reads over gRPC from now on."""

    def __init__(self, message: str):
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


class DirectReader:
    """One broadcast stream on the direct port; iterate it for its chunks, `cancel` it
    from another thread to end it (as a gRPC call's `cancel`)."""

    def __init__(self, sock: socket.socket, silent_s: float):
        self._sock, self._silent_s = sock, silent_s
        self._cancelled = False
        self._framed = False  # a valid frame came: this is a syncer's direct port

    @classmethod
    def open(cls, host: str, port: int, hello: pb.DirectHello,
             keepalive_s: float = net.KEEPALIVE_S) -> DirectReader:
        """Connect and say hello; OSError when the port cannot be reached. The syncer
        pings a stream silent for half of `keepalive_s`; one silent for twice that is
        taken as a dead link or a frozen syncer (UNAVAILABLE: the island joins again)."""
        sock = socket.create_connection((host, port), timeout=CONNECT_S)
        hello.keepalive_s = keepalive_s
        try:
            sock.sendall(wire.direct_hello(hello))
            sock.settimeout(2 * keepalive_s)
        except OSError:
            sock.close()
            raise
        return cls(sock, 2 * keepalive_s)

    def __iter__(self) -> Iterator[wire.Chunk[pb.BroadcastHeader]]:
        try:
            while True:
                frame = self._frame()
                if frame is None:
                    return
                kind, body = frame
                if kind == wire.FRAME_ERROR:
                    raise _status(pb.DirectError.FromString(body))
                if kind == wire.FRAME_HEADER:
                    yield from self._broadcast(pb.BroadcastHeader.FromString(body))
        except DecodeError as e:
            raise ValueError(f"a malformed direct-downlink frame: {e}") from None
        except TimeoutError:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, "no word from the syncer's "
                               f"direct port for {self._silent_s:.0f} s (a dead link, or a "
                               "frozen syncer)") from None
        except OSError as e:
            if self._cancelled:
                raise StatusError(grpc.StatusCode.CANCELLED, "the island closed the "
                                   "direct stream") from None
            raise StatusError(grpc.StatusCode.UNAVAILABLE,
                               f"the direct downlink broke: {e}") from None
        finally:
            self._sock.close()

    def _frame(self) -> tuple[int, bytes] | None:
        """The next frame; before the first valid one, anything else is `NotDirect`."""
        if self._framed:
            return wire.read_frame(self._sock)
        try:
            frame = wire.read_frame(self._sock)
            if frame is not None and frame[0] == wire.FRAME_HEADER:
                pb.BroadcastHeader.FromString(frame[1])
            elif frame is not None and frame[0] == wire.FRAME_ERROR:
                pb.DirectError.FromString(frame[1])
        except (ValueError, DecodeError, ConnectionError) as e:
            raise NotDirect(f"the syncer's direct port answered with something else: {e}"
                            ) from None
        if frame is None:
            raise NotDirect("the syncer's direct port closed before its first frame")
        self._framed = True
        return frame

    def _broadcast(self, header: pb.BroadcastHeader) -> Iterator[wire.Chunk[pb.BroadcastHeader]]:
        """The header's payload, a chunk per `net.CHUNK_BYTES` (one, if it is empty)."""
        left, first = header.payload_bytes, True
        while left or first:
            piece = np.empty(min(left, net.CHUNK_BYTES), np.uint8).data  # (not zeroed)
            wire.read_into(self._sock, piece)
            yield wire.Chunk(header if first else None, piece)
            left, first = left - len(piece), False

    def cancel(self) -> None:
        self._cancelled = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _status(err: pb.DirectError) -> StatusError:
    code = getattr(grpc.StatusCode, err.code, grpc.StatusCode.UNKNOWN)
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    return StatusError(code, err.message)
