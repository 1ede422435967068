"""The island's gRPC client of the syncer.

- `connection`: the channel and credential, joining with backoff on a background
  thread, what the last join said; `TLSConfig`, `status` (one Status call).
- `receiver`: broadcasts in, checked as they arrive, and the downlink's decoding
  state (`Downlink`: the Θ kept to add compressed updates to).
- `sender`: pushes, the seed and Finish out, on one background thread.
- `syncer_client`: `SyncerClient`, the `yeto.transport.Transport` over the three, and
  `connect`.
- `sharded`: `ShardedClient`, the transport to a run served by several shards (one
  `SyncerClient` each).
"""

from yeto.client.connection import TLSConfig, status
from yeto.client.syncer_client import SyncerClient, connect

__all__ = ["SyncerClient", "TLSConfig", "connect", "status"]
