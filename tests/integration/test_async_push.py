"""The push leaves the training loop at once (issue 34), over a real gRPC syncer: the
island keeps stepping while its push is held at the transport, and still ends
bit-identical to the syncer (the scripted-transport checks: tests/unit/
test_async_push.py)."""

import threading

import numpy as np
from helpers.island_chunked import RangedWeights
from helpers.syncer import make_client, running_syncer

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


def _torch_island(addr, guarded, blocking):
    """The torch learner's backend (`TorchBackend.attach`, full weights) on a small
    stack of Linear layers, its island over a real gRPC client."""
    import torch

    from yeto.config import IslandConfig
    from yeto.torch.learner import TorchBackend

    cfg = IslandConfig(device="cpu", tuning="full", inner_lr=1e-2)
    backend = TorchBackend(cfg)
    torch.manual_seed(0)
    backend.model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 32))
    weights = backend.attach(cfg)
    client = make_client(addr, f"torch-{guarded}", weights.layout)
    island = Island(weights, client=client, sync_every=3, chunk=1024, blocking=blocking)
    if guarded:
        island.guard_updates(backend.guard_updates)
    return backend, weights, island


def _torch_steps(backend, island, steps, seen):
    import torch

    for i in range(steps):
        x = torch.linspace(-1, 1, 8 * 64).reshape(8, 64) * (1 + i % 5)
        loss = (backend.model(x) - 0.5).pow(2).mean()
        loss.backward()
        backend.opt.step()  # the guard runs first (a step pre-hook)
        backend.opt.zero_grad()
        seen.append(bool(island.stager.pending))  # staged pushes the guard has not seen
        island.after_step(8)


def test_torch_learner_runs_the_guard_before_each_optimizer_step():
    """The torch learner's optimizer step waits for a push staged in the background
    (its step pre-hook is the guard): nothing is pending after a step, the island
    ends on the syncer's weights, and with blocking sync the run is bit-identical to
    one staged in the training thread."""
    finals = []
    for guarded in (True, False):
        with running_syncer(quorum=1, grace_ms=0) as (run, addr):
            backend, weights, island = _torch_island(addr, guarded, blocking=True)
            assert island.stager.deferred == guarded
            island.start()
            seen = []
            _torch_steps(backend, island, 9, seen)
            assert island.finish() and island.pushes >= 3 and not any(seen)
            assert weights.get().tobytes() == run.theta.tobytes()
            finals.append(weights.get().tobytes())
    assert finals[0] == finals[1]
