"""The syncer's side of the two streaming messages, without protobuf copies of the
payload: `yeto.wire`'s functions (one place for the wire format), under the names
the service registers.

- `parse_push_chunk` (the Push request deserializer): a chunk's header (parsed by the
  generated class) and a zero-copy view of its data;
- `broadcast_chunk` / `chunk_prefix`: a broadcast chunk's wire bytes built straight
  from the weights (one copy), passed through by `serialize_broadcast` (the Subscribe
  response serializer).

The bytes on the wire are exactly what the generated classes produce and accept.
"""

from __future__ import annotations

from yeto.proto import yeto_pb2 as pb
from yeto.wire import Chunk as WireChunk
from yeto.wire import chunk_bytes as broadcast_chunk
from yeto.wire import chunk_prefix, parse_chunk
from yeto.wire import passthrough as serialize_broadcast

__all__ = ["WireChunk", "broadcast_chunk", "chunk_prefix", "parse_chunk", "parse_push_chunk",
           "serialize_broadcast"]


def parse_push_chunk(raw: bytes) -> WireChunk:
    """One PushChunk from its wire bytes; `data` is a view into `raw` (no copy)."""
    return parse_chunk(raw, pb.PushHeader)
