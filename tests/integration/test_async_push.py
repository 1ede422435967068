"""The push leaves the training loop at once (issue 34), over a real gRPC syncer: the
island keeps stepping while its push is held at the transport, and still ends
bit-identical to the syncer (the scripted-transport checks: tests/unit/
test_async_push.py)."""

import threading

import numpy as np
from helpers.island_chunked import RangedWeights
from support import make_client, running_syncer

from yeto.island import Island
from yeto.layout import Layout

HOLD_S = 60.0  # the longest the push is held (a test that forgets to release fails)


def test_island_keeps_stepping_while_its_push_is_held_and_ends_on_the_syncer_weights():
    layout = Layout.from_shapes({"a": (5000,), "b": (3000,)})
    weights = RangedWeights(layout, np.zeros(layout.numel, np.float32))
    with running_syncer(quorum=1, grace_ms=0) as (run, addr):
        client = make_client(addr, "a", layout)
        gate, entered = threading.Event(), threading.Event()
        push = client.push

        def held(payload, **kw):  # the transport returns only once released
            entered.set()
            if not gate.wait(HOLD_S):
                raise TimeoutError("the held push was never released")
            return push(payload, **kw)

        client.push = held
        island = Island(weights, client=client, sync_every=4, chunk=1024)
        assert island.overlapped  # the gRPC client sends in the background
        island.start()
        target = np.linspace(-1, 1, layout.numel, dtype=np.float32)

        def step():
            weights.v -= np.float32(0.05) * (weights.v - target)
            return island.after_step(10)

        for _ in range(4):
            step()  # the fourth pushes
        assert entered.wait(HOLD_S), "the push never reached the transport"
        for _ in range(3):
            step()  # training goes on while the push is held
        assert island.step == 7 and island.ledger.in_flight(0) and run.version == 0
        gate.set()
        for _ in range(9):
            step()
        assert island.finish()
    assert weights.v.tobytes() == run.theta.tobytes()
    assert run.version >= 2 and island.pushes >= 3
