"""A whole fleet in one process: a syncer and k islands, over the project's own code.

`run_fleet` starts the syncer's `Run` and `SyncerService` in this process (no
sockets), then runs k islands, each the real island loop (`yeto.loop.run_island`:
the same state machine, codec with error feedback, data sharding and outputs) on a
torch backend, each in its own thread and talking to the service through
`yeto.sim.transport.LocalClient`. With blocking sync the fleet computes what the same
run through real processes computes; the outputs are a real run's: the syncer's
tape, state and `final/`, and each island's metrics, summary and adapter.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from syncer.run import Config, Run
from syncer.service import SyncerService
from yeto.config import IslandConfig
from yeto.io import atomic_write
from yeto.loop import run_island
from yeto.sim.transport import LocalClient

log = logging.getLogger("yeto.sim")


@dataclass
class FleetResult:
    eval_loss: float
    eval_loss_before: float
    bytes_up: int
    bytes_down: int
    rounds: int
    seconds: float
    islands: dict


def island_configs(base: IslandConfig, k: int, out: Path, speeds: list[float]) -> list:
    """One config per island: its id, shard, output folder and speed (an island s times
    slower trains 1/s of the steps: the same wall time)."""
    cfgs = []
    for i in range(k):
        speed = speeds[i] if speeds else base.slowdown
        steps = max(1, round(base.max_steps / speed)) if speeds and base.max_steps else \
            base.max_steps
        cfgs.append(dataclasses.replace(
            base, learner_id=f"island-{i}", learner_index=i, num_learners=k,
            output=out / "islands" / f"island-{i}", syncer="in-process", progress=False,
            slowdown=speed, max_steps=steps))
    return cfgs


def _import_lazy_modules() -> None:
    """transformers resolves its names lazily, and two threads resolving the same one
    at once can fail: resolve what the islands use here, before they start."""
    import peft  # noqa: F401
    from transformers import (  # noqa: F401
        CONFIG_MAPPING,
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        PreTrainedTokenizerFast,
    )


def _ticker(run: Run, stop: threading.Event) -> None:
    while not stop.wait(0.01):  # commits rounds whose grace window or timeout passed
        run.tick()


def run_fleet(base: IslandConfig, syncer_cfg: Config, k: int, out: Path,
              speeds: list[float] | None = None) -> FleetResult:
    """Run k islands and a syncer in this process; returns the fleet's figures."""
    from yeto.torch.learner import TorchBackend

    _import_lazy_modules()
    out.mkdir(parents=True, exist_ok=True)
    run = Run(dataclasses.replace(syncer_cfg, state_dir=out / "syncer"))
    service = SyncerService(run)

    def connect(cfg: IslandConfig, layout, backend):
        weights_file, files = backend.export_files(cfg)
        return LocalClient(service, cfg.learner_id, layout, backend=backend.name,
                           weights_file=weights_file, export_files=files)

    codes: dict[str, int] = {}
    setup = threading.Lock()

    class SimBackend(TorchBackend):
        def attach(self, cfg: IslandConfig):
            with setup:  # LoRA init draws from torch's global RNG: one island at a time
                return super().attach(cfg)

    def island(cfg: IslandConfig) -> None:
        codes[cfg.learner_id] = run_island(cfg, SimBackend(cfg), connect=connect)

    stop, t0 = threading.Event(), time.perf_counter()
    threading.Thread(target=_ticker, args=(run, stop), daemon=True).start()
    threads = [threading.Thread(target=island, args=(cfg,), name=cfg.learner_id)
               for cfg in island_configs(base, k, out, speeds or [])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    failed = {i: c for i, c in codes.items() if c != 0}
    if failed or len(codes) != k:
        raise RuntimeError(f"islands failed: {failed or 'some did not finish'}; see the log")
    return _collect(out, run, time.perf_counter() - t0)


def _collect(out: Path, run: Run, seconds: float) -> FleetResult:
    summaries = {p.parent.name: json.loads(p.read_text())
                 for p in sorted((out / "islands").glob("*/summary.json"))}
    first = next(iter(summaries.values()))
    result = FleetResult(eval_loss=first["eval_loss"], eval_loss_before=first["eval_loss_before"],
                         bytes_up=sum(s["bytes_up"] for s in summaries.values()),
                         bytes_down=sum(s["bytes_down"] for s in summaries.values()),
                         rounds=run.version, seconds=seconds, islands=summaries)
    atomic_write(out / "summary.json", json.dumps(dataclasses.asdict(result), indent=2))
    return result
