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
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from syncer.run import Config, Run
from syncer.service import SyncerService
from syncer.shards import Shard
from yeto.client.sharded import ShardedClient
from yeto.config import IslandConfig
from yeto.io import atomic_write
from yeto.loop import run_island
from yeto.sim.clock import VirtualClock
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
    simulated_s: float = 0.0  # on simulated time: the fleet's time at the end, and per
    goodput: dict | None = None  # island the share of its time spent training


def island_configs(base: IslandConfig, k: int, out: Path, speeds: list[float],
                   simulated: bool = False) -> list:
    """One config per island: its id, shard, output folder and speed (an island s times
    slower trains 1/s of the steps: the same wall time). On real time a slow island
    sleeps (`slowdown`); on simulated time its steps cost more simulated seconds."""
    cfgs = []
    for i, speed in enumerate(island_speeds(base, k, speeds)):
        steps = max(1, round(base.max_steps / speed)) if speeds and base.max_steps else \
            base.max_steps
        cfgs.append(dataclasses.replace(
            base, learner_id=f"island-{i}", learner_index=i, num_learners=k,
            output=out / "islands" / f"island-{i}", syncer="in-process", progress=False,
            slowdown=1.0 if simulated else speed, max_steps=steps))
    return cfgs


def island_speeds(base: IslandConfig, k: int, speeds: list[float]) -> list[float]:
    """Each island's step time multiplier: `--speeds`, else everyone at `--slowdown`."""
    return list(speeds) or [base.slowdown] * k


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


def shard_config(cfg: Config, out: Path, i: int, shards: int) -> Config:
    """Shard i of `shards` (as `python -m syncer --shard I/S`): its own state dir, at
    least one fragment per shard, island-0 seeding every shard. One shard: the run's
    config, its state in OUT/syncer."""
    if shards == 1:
        return dataclasses.replace(cfg, state_dir=out / "syncer")
    return dataclasses.replace(cfg, state_dir=out / f"syncer-{i}", shard=Shard(i, shards),
                               fragments=max(cfg.fragments, shards),
                               seed_from=cfg.seed_from or "island-0")


def _ticker(run: Run, clock: VirtualClock | None, stop: threading.Event) -> None:
    """Commits rounds whose grace window or timeout passed. On simulated time the
    islands' steps move the clock and tick the run; when every island waits, this
    commits what is due at the fleet's time (an island's Finish can make a round
    complete) and else moves the clock on to the run's next deadline."""
    while not stop.wait(0.01 if clock is None else 0.001):
        if clock is None:
            run.tick()
        elif clock.idle():
            run.tick(clock.fleet_now())
            clock.pass_idle_time(run.next_deadline())


def step_costs(seconds: float, jitter: float, seed: str) -> Iterator[float]:
    """The simulated seconds of an island's successive steps: `seconds` each, times a
    factor drawn uniformly from [1 - jitter, 1 + jitter] when `jitter` > 0 (seeded per
    island, so a run still repeats exactly)."""
    rng = random.Random(seed)
    while True:
        yield seconds * (1.0 + jitter * (2.0 * rng.random() - 1.0)) if jitter else seconds


def run_fleet(base: IslandConfig, syncer_cfg: Config, k: int, out: Path,
              speeds: list[float] | None = None, step_seconds: float = 0.0,
              step_jitter: float = 0.0, syncer_shards: int = 1) -> FleetResult:
    """Run k islands and a syncer in this process; returns the fleet's figures. With
    `step_seconds` > 0 the fleet runs on simulated time (`yeto.sim.clock`): a step at
    speed s costs s × step_seconds (± `step_jitter` of it, see `step_costs`), and
    nobody sleeps. `syncer_shards` S > 1: the run is served by S shards (`shard_config`;
    real time only), each island pushing each fragment to its owner."""
    if syncer_shards > 1 and step_seconds > 0:
        raise ValueError("syncer shards run on real time only: drop the simulated step time")
    _import_lazy_modules()
    out.mkdir(parents=True, exist_ok=True)
    clock = VirtualClock() if step_seconds > 0 else None
    runs = [Run(shard_config(syncer_cfg, out, i, syncer_shards),
                clock=clock.now if clock else time.monotonic)
            for i in range(max(1, syncer_shards))]
    cfgs = island_configs(base, k, out, speeds or [], simulated=clock is not None)
    if clock is not None:
        clock.on_advance, runs[0].on_publish = runs[0].tick, clock.committed
        clock.expect([cfg.learner_id for cfg in cfgs])
    costs = [step_costs(speed * step_seconds, step_jitter, f"{cfg.seed}/{cfg.learner_id}")
             for cfg, speed in zip(cfgs, island_speeds(base, k, speeds or []))]
    bodies = _islands([SyncerService(r) for r in runs], cfgs, clock, costs)
    stop, t0 = threading.Event(), time.perf_counter()
    for run in runs:
        threading.Thread(target=_ticker, args=(run, clock, stop), daemon=True).start()
    threads = [threading.Thread(target=fn, name=name) for name, fn in bodies.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    failed = {i: fn.code for i, fn in bodies.items() if fn.code != 0}
    if failed:
        raise RuntimeError(f"islands failed: {failed}; see the log")
    return _collect(out, runs, time.perf_counter() - t0, clock)


class _Island:
    """One island's thread body; `code` is its exit code once it ran (None: it did not
    finish)."""

    def __init__(self, fn):
        self.fn, self.code = fn, None

    def __call__(self) -> None:
        self.code = self.fn()


def _islands(services: list[SyncerService], cfgs: list[IslandConfig],
             clock: VirtualClock | None, costs: list[Iterator[float]]) -> dict[str, _Island]:
    """The islands' thread bodies: the real island loop on a torch backend, through a
    `LocalClient` (with shards, a `ShardedClient` of one per shard); on simulated time
    each step first takes its turn on the clock."""
    from yeto.torch.learner import TorchBackend

    setup = threading.Lock()

    def local(address: str, learner_id: str, layout, **options) -> LocalClient:
        return LocalClient(services[int(address)], learner_id, layout, clock=clock, **options)

    def connect(cfg: IslandConfig, layout, backend, tokens_per_step: int = 0):
        weights_file, files = backend.export_files(cfg)
        options = dict(backend=backend.name, weights_file=weights_file, export_files=files,
                       tokens_per_step=tokens_per_step)
        if len(services) == 1:
            return local("0", cfg.learner_id, layout, **options)
        return ShardedClient(";".join(str(i) for i in range(len(services))), cfg.learner_id,
                             layout, connect=local, **options)

    class SimBackend(TorchBackend):
        costs: Iterator[float]  # simulated seconds of each step

        def load(self, cfg: IslandConfig, source):
            with setup:  # transformers' loader is not thread-safe (a meta-device model)
                return super().load(cfg, source)

        def attach(self, cfg: IslandConfig):
            with setup:  # LoRA init draws from torch's global RNG: one island at a time
                return super().attach(cfg)

        def train_step(self, micro):
            if clock is not None:
                clock.step(next(self.costs))
            return super().train_step(micro)

    def body(cfg: IslandConfig, costs: Iterator[float]):
        backend = SimBackend(cfg)
        backend.costs = costs
        try:
            return run_island(cfg, backend, connect=connect,
                              clock=clock.now if clock else time.monotonic)
        finally:
            if clock is not None:
                clock.leave()

    return {cfg.learner_id: _Island(lambda c=cfg, s=s: body(c, s))
            for cfg, s in zip(cfgs, costs)}


def _collect(out: Path, runs: list[Run], seconds: float, clock: VirtualClock | None
             ) -> FleetResult:
    summaries = {p.parent.name: json.loads(p.read_text())
                 for p in sorted((out / "islands").glob("*/summary.json"))}
    first = next(iter(summaries.values()))
    result = FleetResult(eval_loss=first["eval_loss"], eval_loss_before=first["eval_loss_before"],
                         bytes_up=sum(s["bytes_up"] for s in summaries.values()),
                         bytes_down=sum(s["bytes_down"] for s in summaries.values()),
                         rounds=sum(r.version for r in runs), seconds=seconds,
                         islands=summaries)
    if clock is not None:
        result.simulated_s = clock.fleet_now()
        result.goodput = clock.goodput()
    atomic_write(out / "summary.json", json.dumps(dataclasses.asdict(result), indent=2))
    return result
