"""Shared fixtures, and the cost tiers: every test is marked by its folder.

  tests/unit/         no processes, no servers, no training
  tests/integration/  in-process gRPC servers, in-process training, the sim
  tests/e2e/          real processes: island and syncer programs, venvs, torchrun,
                      network namespaces

`pytest -m "not e2e"` runs the first two; `slow` tests (long runs) run only when
asked for (`pytest -m slow`). `pytest -m regimes` runs the slow tests that keep every
regime true (RL under the default outer rule, mixed fleets, parity beyond the presets);
`pytest -m long` the minute-scale e2e runs the default tier leaves out to stay quick
(a cut link, a killed rank, twenty chaos faults, the longer how-to pages): .ci/run runs
both after the default tier."""

import logging
import threading
from pathlib import Path

import numpy as np
import pytest

from yeto.layout import Layout

logging.basicConfig(level=logging.INFO)
TIERS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(config, items):
    """Mark each test with its folder's tier; leave out `slow` and `long` unless the
    -m expression names them."""
    expr = config.getoption("markexpr") or ""
    wants_slow = any(m in expr for m in ("slow", "regimes", "real", "long"))
    kept, dropped = [], []
    no_gpu = _no_gpu() if any(i.get_closest_marker("cuda") for i in items) else None
    for item in items:
        tier = next((t for t in TIERS if t in item.path.parts), None)
        if tier is not None:
            item.add_marker(tier)
        if no_gpu and item.get_closest_marker("cuda"):
            item.add_marker(pytest.mark.skip(reason=no_gpu))
        later = item.get_closest_marker("slow") or item.get_closest_marker("long")
        (dropped if later and not wants_slow else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def _no_gpu() -> str | None:
    """Why `cuda` tests cannot run here (None: a CUDA GPU is there)."""
    try:
        import torch
    except ImportError:
        return "needs torch with CUDA"
    return None if torch.cuda.is_available() else "needs a CUDA GPU (scripts/gpu_check.sh)"


@pytest.fixture(autouse=True)
def _own_excepthook():
    """A CLI's main() run in this process (syncer, island) installs die_with_threads:
    put pytest's hook back after each test, or a later test's dying thread ends pytest."""
    hook = threading.excepthook
    yield
    threading.excepthook = hook


@pytest.fixture
def toy_layout():
    return Layout.from_shapes({
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (4, 16),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": (16, 4),
        "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight": (4, 16),
        "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight": (16, 4),
    })


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
