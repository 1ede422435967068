"""The two streaming messages (pushes and broadcasts) as wire bytes, without protobuf
copies of the payload: one place for the wire format, used by islands and the syncer.

`PushChunk` and `BroadcastChunk` are both `{header = 1 (a message), data = 2
(bytes)}`. Built by the generated classes, every chunk's payload is copied three
times (`bytes(view)`, into the message, `SerializeToString`); parsed by them, three
times again. Here a push chunk's wire bytes are built in one copy straight from the
payload (`chunk_bytes`), and a broadcast chunk is parsed into its header and a
zero-copy view of its data (`parse_chunk`; `parse_push_chunk` and
`parse_broadcast_chunk` are the deserializers the syncer and the client register).
`passthrough` is the serializer of calls whose messages are prepared wire bytes. The
bytes on the wire are exactly what the generated classes produce and accept.

Below them, the framing of the direct downlink (broadcasts over a plain TCP port, sent
from Θ's memory): its hello, frames and reads.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Generic, TypeVar

from google.protobuf.message import DecodeError, Message

from yeto.codec.format import Payload, as_view
from yeto.proto import yeto_pb2 as pb

H = TypeVar("H", bound=Message)  # the chunk's header message type

_HEADER, _DATA = 1, 2
_LEN = 2  # wire type of length-delimited fields


@dataclass(frozen=True)
class Chunk(Generic[H]):
    header: H | None
    data: memoryview

    def HasField(self, name: str) -> bool:  # noqa: N802 - as the generated classes say it
        return name == "header" and self.header is not None


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise DecodeError("truncated or oversized varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _skip(buf: memoryview, pos: int, wire_type: int) -> int:
    if wire_type == 0:
        return _varint(buf, pos)[1]
    if wire_type == 1:
        return pos + 8
    if wire_type == 5:
        return pos + 4
    if wire_type == _LEN:
        n, pos = _varint(buf, pos)
        return pos + n
    raise DecodeError(f"unsupported wire type {wire_type}")


def parse_chunk(raw: bytes, header_type: type[H]) -> Chunk[H]:
    """One chunk message from its wire bytes; `data` is a view into `raw` (no copy).
    As protobuf does, a repeated header is merged and a repeated data field keeps the
    last; unknown fields are skipped; malformed input raises DecodeError."""
    buf = memoryview(raw)
    header: H | None = None
    data, pos = buf[0:0], 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if field in (_HEADER, _DATA) and wire_type == _LEN:
            n, pos = _varint(buf, pos)
            if pos + n > len(buf):
                raise DecodeError("field runs past the end of the message")
            value, pos = buf[pos:pos + n], pos + n
            if field == _DATA:
                data = value
            else:
                if header is None:
                    header = header_type()
                # protobuf parses any buffer (no copy of the header made); its stubs say bytes
                header.MergeFromString(value)  # type: ignore[arg-type]
        else:
            pos = _skip(buf, pos, wire_type)
            if pos > len(buf):
                raise DecodeError("field runs past the end of the message")
    return Chunk(header, data)


def parse_push_chunk(raw: bytes) -> Chunk[pb.PushHeader]:
    """One PushChunk from its wire bytes; `data` is a view into `raw` (no copy)."""
    return parse_chunk(raw, pb.PushHeader)


def parse_broadcast_chunk(raw: bytes) -> Chunk[pb.BroadcastHeader]:
    """One BroadcastChunk from its wire bytes; `data` is a view into `raw` (no copy)."""
    return parse_chunk(raw, pb.BroadcastHeader)


def _encode_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def chunk_prefix(header: Message | None, data_len: int) -> bytes:
    """A chunk message's wire bytes up to its data: the header field (if any) and the
    data field's tag and length."""
    head = b""
    if header is not None:
        hb = header.SerializeToString()
        head = bytes([_HEADER << 3 | _LEN]) + _encode_varint(len(hb)) + hb
    return head + bytes([_DATA << 3 | _LEN]) + _encode_varint(data_len)


def chunk_bytes(header: Message | None, data: Payload) -> bytes:
    """A chunk message's wire bytes: the header field (if any), then the data field,
    built with one copy of `data`."""
    view = as_view(data).cast("B")
    return b"".join((chunk_prefix(header, len(view)), view))


def passthrough(message: bytes | bytearray | Message) -> bytes:
    """A request serializer for prepared wire bytes (other messages as usual)."""
    if isinstance(message, (bytes, bytearray)):
        return bytes(message)
    return message.SerializeToString()


# ---- the direct downlink -------------------------------------------------------------
# gRPC's Python API sends `bytes` only, so a broadcast over Subscribe costs a copy of
# each chunk of Θ into a message, gRPC's copy of that message, and two of its threads
# passing it along. A syncer without TLS also serves a *direct port*
# (JoinReply.direct_port): a plain TCP stream on which it hands the kernel views of Θ
# itself (`syncer.direct`). An island that reaches the port reads its broadcasts there
# (`yeto.client.direct`), one that does not (a firewall) over Subscribe: the same
# headers, bytes and checks either way. Everything else stays on gRPC.
#
#   island -> syncer:  DIRECT_MAGIC, u32 n, a DirectHello of n bytes; nothing after
#   syncer -> island:  frames of u8 kind, u32 n, n bytes (integers little-endian):
#                      FRAME_HEADER  a BroadcastHeader; its payload_bytes of raw
#                                    payload follow, unframed
#                      FRAME_ERROR   a DirectError: the stream's end, as a gRPC status
#                      FRAME_PING    the kind byte alone, between broadcasts, after
#                                    the hello's keepalive_s of silence: a frozen
#                                    syncer (whose kernel still answers TCP) is found
#                                    out by the island's read timeout, as gRPC's
#                                    keepalive pings find it out on the other calls
#                      the syncer closes the socket when the stream ends.
DIRECT_MAGIC = b"YETD"
FRAME_HEADER, FRAME_ERROR, FRAME_PING = 1, 2, 3
MAX_FRAME_BYTES = 64 << 10  # a hello, a header or an error is far smaller


def direct_hello(hello: pb.DirectHello) -> bytes:
    body = hello.SerializeToString()
    return DIRECT_MAGIC + len(body).to_bytes(4, "little") + body


def direct_frame(kind: int, message: Message) -> bytes:
    body = message.SerializeToString()
    return bytes([kind]) + len(body).to_bytes(4, "little") + body


def read_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    """`n` bytes from a blocking socket; ConnectionError when it ends before them,
    TimeoutError past `deadline` (`time.monotonic`) or its own timeout."""
    buf = bytearray(n)
    read_into(sock, memoryview(buf), deadline)
    return buf


def read_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill `view` from a blocking socket (`read_exact`'s errors)."""
    n, got = len(view), 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{n - got} bytes of a {n}-byte read still missing")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"the connection ended {n - got} bytes short of a "
                                  f"{n}-byte read")
        got += k


def read_hello(sock: socket.socket, deadline: float) -> pb.DirectHello:
    """The hello a direct connection opens with, whole by `deadline`
    (`time.monotonic`); ValueError for anything else."""
    head = read_exact(sock, len(DIRECT_MAGIC) + 4, deadline)
    if bytes(head[:len(DIRECT_MAGIC)]) != DIRECT_MAGIC:
        raise ValueError("not a direct-downlink hello (a yeto island opens with "
                         f"{DIRECT_MAGIC!r})")
    try:
        body = read_exact(sock, _frame_length(head[-4:]), deadline)
        return pb.DirectHello.FromString(bytes(body))
    except DecodeError as e:
        raise ValueError(f"a malformed direct-downlink hello: {e}") from None


def read_frame(sock: socket.socket) -> tuple[int, bytes] | None:
    """The next frame's kind and body; None when the stream ended between frames."""
    first = sock.recv(1)
    if not first:
        return None
    kind = first[0]
    if kind == FRAME_PING:
        return kind, b""
    if kind not in (FRAME_HEADER, FRAME_ERROR):
        raise ValueError(f"unknown direct-downlink frame kind {kind}")
    return kind, bytes(read_exact(sock, _frame_length(read_exact(sock, 4))))


def _frame_length(raw: bytes | bytearray) -> int:
    n = int.from_bytes(raw, "little")
    if n > MAX_FRAME_BYTES:
        raise ValueError(f"a direct-downlink frame of {n} bytes (at most {MAX_FRAME_BYTES})")
    return n
