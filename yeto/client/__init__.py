"""The island's gRPC client of the syncer.

- `connection`: the channel and credential, joining with backoff on a background
  thread, what the last join said; `TLSConfig`, `status` (one Status call).
- `receiver`: broadcasts in, checked as they arrive, and the downlink's decoding
  state (`Downlink`: the Θ kept to add compressed updates to).
- `direct`: broadcasts read from the syncer's direct port (plain TCP, `yeto.wire`),
  as the chunks Subscribe would have brought.
- `sender`: pushes, the seed and Finish out, on one background thread.
- `syncer_client`: `SyncerClient`, the `yeto.transport.Transport` over the three.
- `sharded`: `ShardedClient`, the transport to a run served by several shards (one
  `SyncerClient` each).

`connect` picks one of the two for a `--syncer` address.
"""

from __future__ import annotations

from yeto.client.connection import TLSConfig, status
from yeto.client.sharded import ShardedClient
from yeto.client.syncer_client import SyncerClient
from yeto.layout import Layout

__all__ = ["SyncerClient", "TLSConfig", "connect", "status"]


def connect(syncer: str | None, learner_id: str, layout: Layout,
            **options) -> SyncerClient | ShardedClient | None:
    """The client of the syncer at `syncer` ('host:port'; a primary and its standbys:
    'A,A2'; the shards of a sharded run, in order: 'A;B'), or None for a single island
    (`syncer` None, '' or 'none'). `options` go to `SyncerClient`."""
    if syncer in (None, "", "none"):
        return None
    if ";" in syncer:
        return ShardedClient(syncer, learner_id, layout, **options)
    return SyncerClient(syncer, learner_id, layout, **options)
