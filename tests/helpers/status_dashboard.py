"""What the status dashboard tests in more than one tier share."""

import threading
import urllib.error
import urllib.request

import numpy as np

from helpers.syncer import make_client
from helpers.wait import wait_until
from yeto.client import SyncerClient
from yeto.island import FlatWeights, Island
from yeto.layout import Layout

LAYOUT = Layout.from_shapes({
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (4, 32),
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": (32, 4)})


EVIL = "<img src=x onerror=alert(1)>"


def _island(address, i, steps=30, token=None):
    """A numpy island pulled toward its own target (islands disagree, losses fall)."""
    rng = np.random.default_rng(i)
    target = rng.standard_normal(LAYOUT.numel).astype(np.float32)
    w = {"v": np.zeros(LAYOUT.numel, np.float32)}

    def set_w(x):
        w["v"] = x.astype(np.float32, copy=True)

    island = Island(FlatWeights(LAYOUT, lambda: w["v"].copy(), set_w),
                    client=make_client(address, f"island-{i}", LAYOUT, token=token),
                    sync_every=5, on_sync=lambda: float(np.mean((w["v"] - target) ** 2)) + i)
    island.start()
    for _ in range(steps):
        w["v"] -= 0.1 * (w["v"] - target)
        if island.after_step(100 * (i + 1), train_loss=float(np.mean((w["v"] - target) ** 2))):
            break
    island.finish()


def run_islands(address, n=2, steps=30, token=None):
    threads = [threading.Thread(target=_island, args=(address, i, steps, token)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def rejected_join(address):
    """A join the syncer refuses, with markup in the learner id (taped as sent)."""
    c = SyncerClient(address, EVIL, Layout.from_shapes({"x.lora_A.weight": (3,)}), backoff_s=0.05)
    c.start(np.zeros(3, np.float32))
    wait_until(lambda: c.fatal is not None, timeout=10)
    c.close()


def http_get(url, headers=None):
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, r.headers.get("Content-Type"), r.read()
