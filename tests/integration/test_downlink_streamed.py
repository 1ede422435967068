"""A compressed downlink to an island that streams large broadcasts: the first Θ (f32,
streamed) must be kept to add the syncer's compressed updates to. Before the fix a
streamed Θ was not kept, so every update failed ("broadcast update against version 0,
but this island holds None") and the island rejoined each round: every model over
8 MiB of trainable f32 (about 2.1M parameters) with --downlink q4."""

from helpers.island_chunked import train_two_islands
from helpers.syncer import running_syncer

from yeto.island import Island


def test_streamed_theta_is_kept_for_compressed_updates(toy_layout, tmp_state):
    joined = {}  # island -> connection generation when its first Θ was applied
    with running_syncer(quorum=2, state_dir=tmp_state, rounds=4, downlink="q4") as (run_, addr):
        def make_island(i, w, client):
            client.receiver.stream_min_bytes = 0  # every f32 broadcast streamed
            return Island(w, client=client, sync_every=3, chunk=64, on_apply=lambda _got:
                          joined.setdefault(i, client.connection.generation))

        done = train_two_islands(addr, toy_layout, make_island)
        theta = run_.theta.copy()
    ends = {i: (joined.get(i), c.connection.generation, getattr(c.connection, "last_error", None))
            for i, (_, c) in done.items()}
    assert all(a == b for a, b, _ in ends.values()), ends  # joined once each
    assert done[0][0].tobytes() == done[1][0].tobytes() == theta.tobytes()
