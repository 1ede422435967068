"""A compressed downlink to an island that streams large broadcasts: the first Θ (f32,
streamed) must be kept to add the syncer's compressed updates to. Before the fix a
streamed Θ was not kept, so every update failed ("broadcast update against version 0,
but this island holds None") and the island rejoined each round: every model over
8 MiB of trainable f32 (about 2.1M parameters) with --downlink q4."""

import threading

import numpy as np
from helpers.island_chunked import RangedWeights
from support import make_client, running_syncer

from yeto.island import Island


def test_streamed_theta_is_kept_for_compressed_updates(toy_layout, tmp_state):
    gens, errors, finals = {}, {}, {}
    with running_syncer(quorum=2, state_dir=tmp_state, rounds=4, downlink="q4") as (run_, addr):
        def island(i):
            w = RangedWeights(toy_layout, np.full(toy_layout.numel, 0.1, np.float32))
            client = make_client(addr, f"i{i}", toy_layout)
            client.receiver.stream_min_bytes = 0  # every f32 broadcast streamed
            isl = Island(w, client=client, sync_every=3, chunk=64)
            isl.start()
            gens[i] = [client.connection.generation]
            for _ in range(12):
                w.v -= np.float32(0.01) * (w.v - i)
                if isl.after_step(5):
                    break
            isl.finish()
            gens[i].append(client.connection.generation)
            errors[i] = getattr(client.connection, "last_error", None)
            finals[i] = w.v.copy()

        threads = [threading.Thread(target=island, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        theta = run_.theta.copy()
    assert all(g[0] == g[1] for g in gens.values()), (gens, errors)  # joined once each
    assert finals[0].tobytes() == finals[1].tobytes() == theta.tobytes()
