import contextlib
import logging
from pathlib import Path

import numpy as np
import pytest

from syncer.run import Config, Run
from syncer.service import SPILL_MIN_BYTES, serve
from yeto.client import SyncerClient
from yeto.layout import Layout

logging.basicConfig(level=logging.INFO)


@contextlib.contextmanager
def running_syncer(token=None, spill_min_bytes=SPILL_MIN_BYTES, **cfg):
    """A real gRPC syncer on a free loopback port, in this process."""
    run = Run(Config(**cfg))
    server, port = serve(run, "127.0.0.1", 0, token=token, spill_min_bytes=spill_min_bytes)
    try:
        yield run, f"127.0.0.1:{port}"
    finally:
        server.ticker_stop.set()
        server.stop(grace=0).wait()
        run.tape.close()


@pytest.fixture
def toy_layout():
    return Layout.from_shapes({
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (4, 16),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": (16, 4),
        "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight": (4, 16),
        "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight": (16, 4),
    })


def make_client(address, learner_id, layout, **kw) -> SyncerClient:
    return SyncerClient(address, learner_id, layout, backoff_s=0.05, max_backoff_s=0.2, **kw)


def wait_until(pred, timeout=20.0, interval=0.02):
    import time
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return True
        time.sleep(interval)
    return False


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def tmp_state(tmp_path) -> Path:
    return tmp_path / "state"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """The pretrained tiny llama (built once per machine into the shared cache)."""
    from yeto.testing.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory) -> tuple[Path, Path]:
    from yeto.testing.tasks import make_task

    return make_task(tmp_path_factory.mktemp("task"))
