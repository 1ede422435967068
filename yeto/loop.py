"""The island driver, and the island program written once for every backend.

`IslandDriver` is one island around a training loop that its caller owns: the
transport to the syncer, the `yeto.island.Island` over the trainable weights, the
rank group, and the metrics the island writes (``OUT/metrics.jsonl``, TensorBoard
scalars with ``report_to``, ``OUT/progress.json``). The caller makes each optimizer
step and hands the driver its loss tokens and loss; the driver applies merged weights
that arrived, pushes when due, and keeps the ranks of a torchrun group in step. The
island program below (`run_island`), the GRPO island (`yeto.rl.run`) and the helpers
for other training loops (`yeto.interop.integrations`: `DiLoCo`, `DiLoCoCallback`,
`MLXDiLoCo`) all drive their islands through it.

`run_island(cfg, backend)` is all of an island program but the tensor engine: pin the
model, read and shard the data, join the syncer, train with syncs every H steps (or T
seconds), stop cleanly on the first SIGINT/SIGTERM, finish, evaluate, write the
metrics, summary and provenance, save. A backend (`yeto.torch.learner.TorchBackend`,
`yeto.mlx.learner.MLXBackend`; by name: `yeto.backends`) supplies only what differs
(`Backend`). Its trainable weights are a `yeto.island.Weights`: a flat float32 view
under canonical names, with range access where the backend has it.

A group whose ranks each hold a shard of the model (FSDP, `sharded`) runs the
island on rank 0 through `group.island_weights(weights)` (range accesses that the
other ranks serve while they wait in `group.share`), evaluates and saves on every
rank, and runs the island's evaluation through `group.collective`.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from yeto.config import IslandConfig
from yeto.io import atomic_write, finite_or_none
from yeto.island import Island, Weights
from yeto.layout import Layout
from yeto.metrics import MetricsWriter
from yeto.signals import GracefulStop
from yeto.transport import Refused, Transport

log = logging.getLogger("yeto.island")

EXIT_OK, EXIT_BAD_INPUT, EXIT_NOT_FEDERATED = 0, 2, 3
PROGRESS_FILE = "progress.json"  # `LiveProgress`


class Group(Protocol):
    """The ranks of one island: `Solo` for one process, `yeto.torch.group.TorchGroup`
    for a torchrun group (`yeto.torch.fsdp.FSDPGroup` when the ranks shard the model).
    Only the leader (rank 0) talks to the syncer."""

    rank: int
    world: int
    leader: bool
    active: bool    # more than one rank
    sharded: bool   # each rank holds a shard of the model

    def sum(self, value: int) -> int:
        """`value` summed over the ranks."""

    def island_weights(self, weights: Weights) -> Weights:
        """The weights the island on this rank works on."""

    def collective(self, fn: Callable[[], float]) -> Callable[[], float]:
        """`fn` as rank 0's island calls it (a sharded group runs it on every rank)."""

    def share(self, applied: bool, weights: Weights, done: bool = False) -> tuple[bool, bool]:
        """Rank 0's (done, applied) and, when applied, its weights reach every rank."""

    def record_weights(self, out: Path, step: int | str, weights: Weights) -> None:
        """Note this rank's weights digest after step `step` (OUT/rank-N.jsonl)."""

    def close(self) -> None:
        """Tear the group down (after the model is released)."""


class Solo:
    """The `Group` of a one-process island."""

    rank, world, leader, active, sharded = 0, 1, True, False, False

    def sum(self, value: int) -> int:
        return value

    def island_weights(self, weights: Weights) -> Weights:
        return weights

    def collective(self, fn: Callable[[], float]) -> Callable[[], float]:
        return fn

    def share(self, applied: bool, weights: Weights, done: bool = False) -> tuple[bool, bool]:
        return done, applied

    def record_weights(self, out: Path, step: int | str, weights: Weights) -> None:
        pass

    def close(self) -> None:
        pass


class Backend(Protocol):
    """The tensor engine of an island program (`run_island`): everything but the loop."""

    name: str
    group: Group  # the ranks of one island (`Solo` for one process)

    def load(self, cfg: IslandConfig, source) -> Any:
        """Load the base model; returns its tokenizer."""

    def attach(self, cfg: IslandConfig) -> Weights:
        """LoRA (or full weights) and the inner optimizer; returns the trainable weights."""

    def export_files(self, cfg: IslandConfig) -> tuple[str, dict[str, str]]:
        """(weights file name, {name: text}): what the syncer writes beside its final
        weights (e.g. a peft adapter_config.json)."""

    def train_step(self, micro_batches: list) -> tuple[float, int]:
        """One optimizer step over the micro-batches; returns (loss, loss tokens)."""

    def guard_updates(self, before_update: Callable[[], None]) -> bool:
        """Call `before_update` (the island's guard) right before each change the step
        makes to the weights, and return True; False where the backend cannot (then
        pushes are staged in the training thread)."""

    def evaluate(self, blocks, batch_size: int) -> float:
        """The mean held-out loss over `blocks`."""

    def save(self, cfg: IslandConfig, out: Path) -> Path:
        """Write the final adapter or model under `out`; returns its folder."""

    def describe(self) -> str:
        """The engine and device, for the log (e.g. "torch cpu")."""

    def release(self) -> None:
        """Drop the model and optimizer: the run is over and saved (called before the
        group goes, which a sharded model holds)."""


# ---- the driver -------------------------------------------------------------------
class IslandDriver:
    """One island around a training loop its caller owns.

    It owns the transport (`client`; None: a single island, which pushes nothing), the
    `Island` over `weights` (`island_options` go to it: `sync_every`, `wire`,
    `merge_alpha`, ...), the rank `group` (only rank 0's island talks to the syncer),
    and, on rank 0, the metrics: ``OUT/metrics.jsonl`` (with TensorBoard scalars when
    `report_to` names "tensorboard") and, with `live_progress`, ``OUT/progress.json``.
    `on_sync()` returns the held-out loss, evaluated before each push; `guard` installs
    the island's guard in the training loop (`Island.guard_updates`).

    A run: `start()` joins; `begin(**fields)` writes the step-0 line (the training
    rate counts from there); `step(loss_tokens, loss)` once per optimizer step, which
    writes a line per push (a single island: one every `sync_every` steps) unless the
    caller writes its own (`sync_lines=False`, `write`); `finish()`; `summary(...)`;
    `close()`."""

    def __init__(self, weights: Weights, client: Transport | None, *,
                 group: Group | None = None, out: str | Path | None = None,
                 report_to: str | tuple[str, ...] = (), sync_lines: bool = True,
                 live_progress: bool = False, on_sync: Callable[[], float] | None = None,
                 guard: Callable[[Callable[[], None]], bool] | None = None,
                 **island_options):
        self.weights, self.client = weights, client
        self.group = group if group is not None else Solo()
        self.out = Path(out) if out is not None else None
        leader = self.group.leader
        self.metrics = MetricsWriter(self.out, report_to) \
            if leader and (self.out is not None or report_to) else None
        self.live = LiveProgress(self.out) if live_progress and leader else None
        self.sync_lines = sync_lines
        if on_sync is not None:
            on_sync = self.group.collective(on_sync)
        self.island = Island(self.group.island_weights(weights), client=client,
                             on_sync=on_sync, **island_options)
        if guard is not None and leader:
            self.island.guard_updates(guard)
        self.steps = 0
        self._t0 = time.perf_counter()

    @classmethod
    def for_config(cls, cfg: IslandConfig, weights: Weights, client: Transport | None, *,
                   clock: Callable[[], float] = time.monotonic, **options) -> IslandDriver:
        """The driver of an island program run with `cfg` (its output folder and sync
        settings); `options` as the constructor's."""
        return cls(weights, client, out=cfg.output, sync_every=cfg.sync_every,
                   sync_every_seconds=cfg.sync_every_seconds, merge_alpha=cfg.merge_alpha,
                   pipeline=cfg.pipeline, wire=cfg.wire, blocking=cfg.blocking_sync,
                   clock=clock, **options)

    @property
    def version(self) -> int:
        """Version of the merged weights the island builds on (-1 before joining)."""
        return self.island.version

    def start(self) -> None:
        """Join the run and adopt its Θ (waits for the quorum; raises
        `yeto.transport.Refused` when the syncer refuses the island); every rank of the
        group then holds rank 0's weights."""
        self.island.start()
        self.group.share(True, self.weights)

    def begin(self, **fields) -> None:
        """The run's first metrics line: step 0 with `fields` (e.g. the held-out loss
        before training) and the version joined. The training rate counts from here."""
        self.write(dict(step=0, **fields, version=self.island.version, time=time.time()))
        self._t0 = time.perf_counter()

    def step(self, loss_tokens: int, loss: float | None = None, stopping: bool = False
             ) -> bool:
        """After one optimizer step of this rank's `loss_tokens` and training `loss`:
        the island applies what arrived and pushes when due, the other ranks follow
        (merged weights, the end of the run), and a metrics line is written at a push.
        Returns True when the run is over (the final weights are loaded), or rank 0 is
        `stopping`: rank 0 decides, so every rank leaves at the same step."""
        group, island = self.group, self.island
        self.steps += 1
        loss_tokens = group.sum(int(loss_tokens))
        pushes, versions = island.pushes, dict(island.versions)
        done = island.after_step(loss_tokens, train_loss=loss) if group.leader else False
        done = done or (stopping and group.leader)
        if group.active:
            done, applied = group.share(island.versions != versions, self.weights, done)
            if applied and self.out is not None:
                group.record_weights(self.out, self.steps, self.weights)
        if self.sync_lines and (island.pushes != pushes or (
                island.client is None and island.step % island.schedule.sync_every == 0)):
            self.write(dict(step=island.step, train_loss=island.train_loss,
                            eval_loss=island.eval_loss, version=island.version,
                            loss_tokens=island.total_tokens,
                            tokens_per_s=island.total_tokens / self.seconds(),
                            time=time.time()))
        if self.live is not None and loss is not None:
            self.live.step(island.step, loss)
        return done

    def seconds(self) -> float:
        """Seconds since `begin` (before it: since the driver was made)."""
        return max(time.perf_counter() - self._t0, 1e-9)

    def write(self, record: dict) -> None:
        """Append `record` to the metrics (rank 0; nothing without an output)."""
        if self.metrics is not None:
            self.metrics.write(record)

    def finish(self) -> bool:
        """Last push, then the final Θ (rank 0), which every rank then holds. Returns
        True when the final weights arrived (the island is then bit-identical to the
        syncer)."""
        if self.group.leader:
            self.island.finish()
        self.group.share(True, self.weights)
        if self.out is not None and self.group.active:  # every rank's final weights
            self.group.record_weights(self.out, "final", self.weights)
        return self.island.finished

    def summary(self, eval_before: float, eval_after: float,
                tokens_per_s: float | None = None) -> dict:
        """The run's record: steps, the held-out loss before and after training, rounds,
        pushes, traffic. `tokens_per_s`: the training rate (default: loss tokens per
        second since `begin`)."""
        island, client = self.island, self.client
        if tokens_per_s is None:
            tokens_per_s = island.total_tokens / self.seconds()
        return dict(step=island.step, eval_loss=eval_after, eval_loss_before=eval_before,
                    version=island.version, final=island.finished,
                    loss_tokens=island.total_tokens, pushes=island.pushes,
                    bytes_up=client.bytes_up if client else 0,
                    bytes_down=client.bytes_down if client else 0,
                    wait_s=client.wait_s if client else 0.0, ranks=self.group.world,
                    tokens_per_s=tokens_per_s)

    def exit_code(self, syncer: str | None, allow_solo: bool = False) -> int:
        """Non-zero for a federated island that never joined a round: a run that never
        federated must not look like success (unless `allow_solo`)."""
        client = self.client
        if client is None or self.island.versions:  # single island, a non-leader, or joined
            return EXIT_OK
        why = client.fatal or client.last_error or "no answer"
        message = (f"this island never joined a round: the syncer at {syncer} was not "
                   f"reached (last error: {why}). Check the address and that `python -m "
                   "syncer` runs there")
        if allow_solo:
            log.warning("%s; it trained alone (--allow-solo)", message)
            return EXIT_OK
        log.error("%s; to train alone on purpose, pass --allow-solo", message)
        return EXIT_NOT_FEDERATED

    def leave(self) -> None:
        """Leave the run without finishing (an error, Ctrl-C): the transport closes, and
        the syncer sees the island go."""
        if self.client is not None:
            self.client.close()

    def close(self) -> None:
        """Close the metrics writer (TensorBoard's files)."""
        if self.metrics is not None:
            self.metrics.close()


class LiveProgress:
    """OUT/progress.json: the island's step and training loss between its pushes, for
    `yeto launch`'s view (metrics.jsonl has a line per sync). Rewritten at most every
    `EVERY_S` seconds (the first step always), never fsynced: a reader may miss a step,
    never see half a file."""

    EVERY_S = 1.0

    def __init__(self, out: Path | None):
        self.path = None if out is None else out / PROGRESS_FILE
        self.last = -math.inf

    def step(self, step: int, train_loss: float) -> None:
        now = time.monotonic()
        if self.path is None or now - self.last < self.EVERY_S:
            return
        self.last = now
        atomic_write(self.path, json.dumps(dict(step=step, train_loss=finite_or_none(
            train_loss), time=time.time())), durable=False)


@dataclass
class Inputs:
    """What an island trains on, pinned: the model source, data and provenance."""

    source: Any
    train: Any
    held_out: Any | None
    provenance: dict


# ---- the island program ------------------------------------------------------------
def run_island(cfg: IslandConfig, backend: Backend, connect=None,
               clock: Callable[[], float] = time.monotonic) -> int:
    """Run one island to the end; returns the process exit code. `connect(cfg, layout,
    backend) -> Transport | None` opens the transport (default `make_client`: gRPC to
    `cfg.syncer`; `yeto.sim` passes an in-process one, and its simulated `clock`)."""
    group = backend.group
    setup_logging(cfg, group)
    try:
        inputs = prepare(cfg, backend)
        weights = backend.attach(cfg)
    except (OSError, ValueError) as e:  # missing files, bad data or model: say which
        log.error("%s", e)
        return EXIT_BAD_INPUT
    client = (connect or make_client)(cfg, weights.layout, backend,
                                      tokens_per_step=step_tokens(cfg, group)) \
        if group.leader else None
    driver = IslandDriver.for_config(cfg, weights, client, clock=clock, group=group,
                                     live_progress=True, guard=backend.guard_updates,
                                     on_sync=lambda: evaluate(backend, cfg, inputs))
    log.info("%d trainable tensors, %d parameters (%s, %s); %d training blocks, "
             "%d loss tokens%s", len(weights.layout.specs), weights.layout.numel, cfg.tuning,
             backend.describe(), len(inputs.train), inputs.train.loss_tokens,
             f"; {group.world} ranks" if group.active else "")
    with GracefulStop(on_first=_stopping) as stop:
        try:
            driver.start()
        except Refused as e:
            log.error("%s", e)
            return EXIT_NOT_FEDERATED
        before = leader_eval(backend, cfg, inputs)
        driver.begin(eval_loss=before)
        tokens_per_s = train(cfg, backend, driver, inputs.train, stop)
        driver.finish()
    after = leader_eval(backend, cfg, inputs, before)
    summary = driver.summary(before, after, tokens_per_s)
    if cfg.output and (group.leader or group.sharded):
        save_outputs(cfg, backend, inputs, summary, driver)
    code = driver.exit_code(cfg.syncer, cfg.allow_solo)
    driver.close()
    # the model goes before the process group it holds (FSDP): a group destroyed while
    # sharded tensors still use it made gloo abort the process at exit under load
    del driver, weights
    backend.release()
    gc.collect()
    group.close()
    return code


def _stopping(name: str) -> None:
    log.warning("%s: stopping after this step; finishing and saving (again to stop at once)",
                name)


def setup_logging(cfg: IslandConfig, group: Group) -> None:
    who = cfg.learner_id + (f"/{group.rank}" if group.active else "")
    logging.basicConfig(level=cfg.log_level.upper() if group.leader else "WARNING",
                        format=f"%(asctime)s {who} %(message)s", datefmt="%H:%M:%S")


def prepare(cfg: IslandConfig, backend: Backend) -> Inputs:
    """Pin the model, load it, read this island's shard of the data (and its rank's
    slice in a torchrun group), and write the provenance before training starts."""
    from yeto.data import load_blocks
    from yeto.data.models import resolve_model
    from yeto.data.provenance import build_record, write_provenance

    source = resolve_model(cfg.model, cfg.model_revision, cfg.trust_remote_code)
    tok = backend.load(cfg, source)
    packing = packing_for(cfg.packing, Path(source.path) / "config.json")
    train_blocks = load_blocks(cfg.data, tok, cfg.seq_len, shard=cfg.shard, packing=packing,
                               revision=cfg.data_revision, split=cfg.data_split)
    held_out = load_blocks(cfg.eval_data, tok, cfg.seq_len, packing=packing,
                           revision=cfg.eval_data_revision, split=cfg.eval_split,
                           held_out=True) if cfg.eval_data else None
    group = backend.group
    if group.active:  # each rank trains on its own slice of the island's shard
        train_blocks = train_blocks[group.rank::group.world]
    record = build_record(source, train_blocks.info["source"], cfg, backend=backend.name,
                          eval_data=held_out.info["source"] if held_out else None)
    if cfg.output and group.leader:
        write_provenance(cfg.output, record)
    if held_out is not None and cfg.eval_blocks:
        held_out = held_out[:cfg.eval_blocks]
    return Inputs(source, train_blocks, held_out, record)


# config keys of mixers that are not attention (short convolutions, state-space scans)
_NON_ATTENTION_KEYS = ("conv_L_cache", "conv_kernel", "d_conv", "ssm_state_size", "state_size",
                       "mamba_d_state", "linear_conv_kernel_dim", "conv1d_width", "lru_width")
_LAYER_LISTS = ("layer_types", "block_types", "layers_block_type")
_RECURRENT = ("linear", "lightning", "recurrent", "mamba", "conv", "ssm", "rwkv")


def mixes_outside_attention(config: dict) -> bool:
    """True when some layer of the model (or of its text model) mixes tokens outside
    softmax attention: convolution, state-space, recurrent or linear-attention layers,
    which carry state across a document boundary that no attention mask reaches."""
    for level in (config, config.get("text_config")):
        if not isinstance(level, dict):
            continue
        if any(k in level for k in _NON_ATTENTION_KEYS):
            return True
        kinds = [str(t).lower() for key in _LAYER_LISTS for t in (level.get(key) or ())]
        if any(("attention" not in t and "attn" not in t) or any(r in t for r in _RECURRENT)
               for t in kinds):
            return True
    return False


def packing_for(packing: str, config_json: Path) -> str:
    """`document` packing keeps packed documents apart with an attention mask; a model
    that mixes tokens outside attention (`mixes_outside_attention`: LFM2, Mamba, Qwen3.5's
    linear attention, RecurrentGemma, hybrids) would carry one document into the next
    where no mask reaches, so both backends fall back to `naive` for it."""
    if packing != "document" or not config_json.is_file():
        return packing
    config = json.loads(config_json.read_text())
    if mixes_outside_attention(config):
        log.warning("--packing document needs attention-only layers; this %s model mixes "
                    "tokens in convolution/state-space/linear-attention layers, so packed "
                    "blocks are naive (pass --packing naive to silence this)",
                    config.get("model_type", "?"))
        return "naive"
    return packing


def step_tokens(cfg: IslandConfig, group) -> int:
    """The most tokens one optimizer step of the island holds: what it declares to the
    syncer, which refuses pushes claiming more loss tokens per step."""
    return cfg.batch_size * cfg.seq_len * cfg.grad_accum * group.world


def make_client(cfg: IslandConfig, layout: Layout, backend: Backend,
                tokens_per_step: int = 0, regime: str = "sft") -> Transport | None:
    """The gRPC transport to `cfg.syncer` (None for a single island). `tokens_per_step`:
    the island's declaration (`step_tokens`; 0: none, the syncer's cap binds); `regime`:
    what it trains, "sft" or "rl" (the GRPO island)."""
    if not cfg.syncer:
        return None
    from yeto.client import TLSConfig, connect

    weights_file, files = backend.export_files(cfg)
    return connect(cfg.syncer, cfg.learner_id, layout, token=cfg.token, backend=backend.name,
                   weights_file=weights_file, export_files=files,
                   tls=TLSConfig.from_files(cfg.tls_ca, cfg.tls_cert, cfg.tls_key),
                   keepalive_s=cfg.keepalive_s, tokens_per_step=tokens_per_step,
                   regime=regime,
                   sync_every=0 if cfg.sync_every_seconds > 0 else cfg.sync_every)


# ---- training ----------------------------------------------------------------------
def train(cfg: IslandConfig, backend: Backend, driver: IslandDriver, blocks,
          stop: GracefulStop) -> float:
    """The inner loop: one optimizer step per iteration, then the island's turn
    (`IslandDriver.step`: apply arrived weights, push when due). In a torchrun group
    only rank 0's island talks to the syncer; merged weights reach the other ranks at
    the same step boundary. Returns the island's training tokens per second (all ranks
    together)."""
    from yeto.data import BatchSampler

    group = backend.group
    sampler = BatchSampler(blocks, cfg.batch_size, seed=cfg.seed + cfg.resolved_index())
    t0, seen = time.perf_counter(), 0
    with progress(cfg, f"{cfg.learner_id} ({backend.name})", group.leader) as bar:
        for _ in range(cfg.max_steps):
            t_step = time.perf_counter()
            micro = [next(sampler) for _ in range(cfg.grad_accum)]
            loss, loss_tokens = backend.train_step(micro)
            seen += sum(mb[0].shape[0] * (mb[0].shape[1] - 1) for mb in micro)
            if cfg.slowdown > 1:  # a slower machine, simulated: stretch the step
                time.sleep((cfg.slowdown - 1) * (time.perf_counter() - t_step))
            # rank 0 decides when to stop (a signal, a non-finite loss)
            done = driver.step(loss_tokens, loss,
                               stopping=stop.is_set() or not math.isfinite(loss))
            bar(loss, seen / (time.perf_counter() - t0), driver.version)
            if not math.isfinite(loss) and group.leader:
                log.error("training loss is %s at step %d: lower --inner-lr", loss,
                          driver.island.step)
            if done:
                break
    return group.sum(seen) / (time.perf_counter() - t0)


class progress:
    """A progress bar on stderr (rich), or nothing with --no-progress / on other ranks.
    Called once per step with (loss, tokens/s, version)."""

    def __init__(self, cfg: IslandConfig, desc: str, leader: bool):
        self.enabled = cfg.progress and leader
        self.total, self.desc = cfg.max_steps, desc

    def __enter__(self):
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                                 console=Console(stderr=True), refresh_per_second=1)
            self._bar.start()
            self._task = self._bar.add_task(self.desc, total=self.total, info="")
        return self

    def __call__(self, loss: float, tokens_per_s: float, version: int) -> None:
        if self.enabled:
            info = f"loss {loss:.3f}  {tokens_per_s:.0f} tok/s  round {version}"
            self._bar.update(self._task, advance=1, info=info)

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._bar.stop()


# ---- evaluation, outputs -------------------------------------------------------------
def evaluate(backend: Backend, cfg: IslandConfig, inputs: Inputs) -> float:
    if inputs.held_out is None:
        return float("nan")
    return backend.evaluate(inputs.held_out, cfg.batch_size)


def leader_eval(backend: Backend, cfg: IslandConfig, inputs: Inputs,
                before: float | None = None) -> float:
    """The held-out loss on rank 0, logged (before training, or after with `before`).
    A sharded group evaluates on every rank (each forward needs them all)."""
    if not backend.group.leader:
        if backend.group.sharded and inputs.held_out is not None:
            evaluate(backend, cfg, inputs)
        return float("nan")
    if inputs.held_out is None:
        if before is None:
            log.info("no --eval-data: the held-out loss is not measured")
        return float("nan")
    loss = evaluate(backend, cfg, inputs)
    if before is None:
        log.info("held-out loss before training: %.4f", loss)
    else:
        log.info("held-out loss after training: %.4f (before %.4f)", loss, before)
    return loss


def save_outputs(cfg: IslandConfig, backend: Backend, inputs: Inputs, summary: dict,
                 driver: IslandDriver) -> None:
    """Rank 0 saves the model and the run's records: the summary as the last metrics
    line and as summary.json (every rank of a sharded group takes part in gathering
    the model)."""
    from yeto.data.provenance import write_provenance

    saved = backend.save(cfg, cfg.output)
    if not backend.group.leader:
        return
    write_provenance(saved, inputs.provenance)
    driver.write(summary)
    atomic_write(cfg.output / "summary.json", json.dumps(summary, indent=2))
    log.info("saved to %s", cfg.output)
