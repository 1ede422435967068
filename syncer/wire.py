"""The syncer's side of the two streaming messages, without protobuf copies of the payload.

`PushChunk` and `BroadcastChunk` are `{header = 1 (a message), data = 2 (bytes)}`.
Parsed by the generated classes, every 4 MiB chunk's payload is copied three times
(into the message, out of it on `.data`, into the receiver); built by them, three
times again (`bytes(view)`, into the message, `SerializeToString`). Here:

- `parse_push_chunk` (the Push request deserializer) reads the protobuf wire format
  of one chunk and returns its header (parsed by the generated class) and a
  zero-copy view of its data (`parse_chunk` does the same for a BroadcastChunk: an
  island's receiver could use it, from a module of yeto's own);
- `broadcast_chunk` builds the wire bytes of one broadcast chunk straight from the
  weights (one copy), and `serialize_broadcast` (the Subscribe response serializer)
  passes them through.

The bytes on the wire are exactly what the generated classes produce and accept, so
islands parse them with `BroadcastChunk.FromString` as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError

from yeto.proto import yeto_pb2 as pb

_HEADER, _DATA = 1, 2
_LEN = 2  # wire type of length-delimited fields


@dataclass(frozen=True)
class WireChunk:
    header: pb.PushHeader | pb.BroadcastHeader | None
    data: memoryview


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


def parse_push_chunk(raw: bytes) -> WireChunk:
    """One PushChunk from its wire bytes; `data` is a view into `raw` (no copy)."""
    return parse_chunk(raw, pb.PushHeader)


def parse_chunk(raw: bytes, header_type) -> WireChunk:
    """A `{header = 1, data = 2}` chunk (PushChunk: `pb.PushHeader`; BroadcastChunk:
    `pb.BroadcastHeader`) from its wire bytes; `data` is a view into `raw`. As
    protobuf does, a repeated header is merged and a repeated data field keeps the
    last; unknown fields are skipped; malformed input raises DecodeError."""
    buf = memoryview(raw)
    header, data, pos = None, buf[0:0], 0
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
                header.MergeFromString(value)
        else:
            pos = _skip(buf, pos, wire_type)
            if pos > len(buf):
                raise DecodeError("field runs past the end of the message")
    return WireChunk(header, data)


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


def chunk_prefix(header: pb.BroadcastHeader | None, data_len: int) -> bytes:
    """The wire bytes of a BroadcastChunk up to its data: the header field (if any)
    and the data field's tag and length."""
    head = b""
    if header is not None:
        hb = header.SerializeToString()
        head = bytes([_HEADER << 3 | _LEN]) + _encode_varint(len(hb)) + hb
    return head + bytes([_DATA << 3 | _LEN]) + _encode_varint(data_len)


def broadcast_chunk(header: pb.BroadcastHeader | None, data) -> bytes:
    """A BroadcastChunk's wire bytes (one copy of `data`)."""
    return b"".join((chunk_prefix(header, len(memoryview(data).cast("B"))), data))


def serialize_broadcast(message) -> bytes:
    """The Subscribe response serializer: prepared wire bytes pass through."""
    if isinstance(message, (bytes, bytearray)):
        return bytes(message)
    return message.SerializeToString()
