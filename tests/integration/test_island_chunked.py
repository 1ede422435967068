"""The island's chunked paths (range access to the weights, payloads encoded piece by
piece, broadcasts applied piece by piece or as they stream in) give bit-identical
results to the whole-array paths (get/set only), and to the documented math.

Here: the checks through in-process servers, training or the sim (the others:
tests/unit/test_island_chunked.py)."""



import numpy as np
import pytest
from helpers.island_chunked import train_two_islands
from helpers.syncer import make_client, running_syncer

from yeto import net
from yeto.island import Island
from yeto.layout import Layout
from yeto.transport import ThetaStream

# ---- weights objects ---------------------------------------------------------------


def test_streamed_broadcasts_over_grpc_end_bit_identical(toy_layout, tmp_state):
    """Two islands against a real syncer, broadcasts streamed to one of them (the
    client's threshold lowered to 0): both end on the syncer's final Θ exactly."""
    streamed = []
    with running_syncer(quorum=2, state_dir=tmp_state, rounds=4) as (run_, addr):
        def make_island(i, w, client):
            if i == 0:
                client.receiver.stream_min_bytes = 0
            return Island(w, client=client, sync_every=3, chunk=64, on_apply=lambda got:
                          streamed.append(isinstance(got.theta, ThetaStream)))

        done = train_two_islands(addr, toy_layout, make_island)
        theta = run_.theta.copy()
    assert any(streamed) and not all(streamed)
    assert done[0][0].tobytes() == done[1][0].tobytes() == theta.tobytes()


@pytest.mark.parametrize("message_bytes", [1 << 20, 4 << 20])
def test_pushes_and_broadcasts_pass_in_this_and_the_last_releases_messages(
        message_bytes, monkeypatch, tmp_state):
    """A 12 MiB fragment through a real syncer in 1 MiB messages (this release) and in
    4 MiB ones (the last release's broadcasts; both ends accept them): the seed pushed
    up, Θ back whole to one client and streamed to another, every byte the same."""
    monkeypatch.setattr(net, "CHUNK_BYTES", message_bytes)
    layout = Layout.from_shapes({"w": (3 << 20,)})
    seed = np.random.default_rng(0).standard_normal(layout.numel, dtype=np.float32)
    with running_syncer(quorum=1, state_dir=tmp_state) as (_, addr):
        clients = [make_client(addr, name, layout) for name in ("whole", "streamed")]
        clients[1].stream_broadcasts()
        try:
            got = []
            for c in clients:
                c.start(seed)
                got.append(c.wait_one(timeout=60))
            assert isinstance(got[1].theta, ThetaStream)
            streamed = np.concatenate(list(got[1].theta.pieces()))
            assert got[0].theta.tobytes() == streamed.tobytes() == seed.tobytes()
        finally:
            for c in clients:
                c.close()
