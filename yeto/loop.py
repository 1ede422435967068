"""The island loop, written once for every backend.

`run_island(cfg, backend)` is all of an island but the tensor engine: pin the model,
read and shard the data, join the syncer, train with syncs every H steps (or T
seconds), stop cleanly on the first SIGINT/SIGTERM, finish, evaluate, write the
metrics, summary and provenance, save. A backend (`yeto.torch.learner.TorchBackend`,
`yeto.mlx.learner.MLXBackend`) supplies only what differs:

    load(cfg, source) -> tokenizer        the base model and its tokenizer
    attach(cfg) -> Weights                LoRA (or full weights) + the inner optimizer
    export_files(cfg) -> (name, files)    what the syncer writes beside its final weights
    train_step(micro_batches) -> (loss, loss tokens)
    evaluate(blocks, batch_size) -> mean held-out loss
    save(cfg, out) -> folder              the final adapter or model
    describe() -> str                     e.g. "torch cpu", for the log
    group                                 ranks of one island (`Solo` for one process)

`Weights` is the backend's flat float32 view of the trainable tensors under their
canonical names: `.layout`, `.get() -> np.ndarray`, `.set(np.ndarray)`, and
optionally range access, which lets the island work chunk by chunk without a flat
copy of the model: `.read_range(lo, hi) -> np.ndarray`, `.write_range(lo, hi,
values)` and `.flush()` (called after each pass of range accesses). The island may
change the array `read_range` returns and pass it back to `write_range`: a read may
be a view of the weights (then a write of that same view has nothing to copy).

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
from yeto.signals import GracefulStop
from yeto.transport import Refused, Transport

log = logging.getLogger("yeto.island")

EXIT_OK, EXIT_BAD_INPUT, EXIT_NOT_FEDERATED = 0, 2, 3
PROGRESS_FILE = "progress.json"  # `LiveProgress`


class Solo:
    """The rank group of a one-process island (a torchrun group implements the same)."""

    rank, world, leader, active, sharded = 0, 1, True, False, False

    def sum(self, value: int) -> int:
        return value

    def island_weights(self, weights: Weights) -> Weights:
        """The weights the island on this rank works on."""
        return weights

    def collective(self, fn):
        """`fn` as rank 0's island calls it (a sharded group runs it on every rank)."""
        return fn

    def share(self, applied: bool, weights: Weights, done: bool = False) -> tuple[bool, bool]:
        """Rank 0's (done, applied) and, when applied, its weights reach every rank."""
        return done, applied

    def close(self) -> None:
        pass


class Backend(Protocol):
    name: str
    group: Any

    def load(self, cfg: IslandConfig, source) -> Any: ...

    def attach(self, cfg: IslandConfig) -> Weights: ...

    def export_files(self, cfg: IslandConfig) -> tuple[str, dict[str, str]]: ...

    def train_step(self, micro_batches: list) -> tuple[float, int]: ...

    def evaluate(self, blocks, batch_size: int) -> float: ...

    def save(self, cfg: IslandConfig, out: Path) -> Path: ...

    def describe(self) -> str: ...

    def release(self) -> None:
        """Drop the model and optimizer: the run is over and saved (called before the
        group goes, which a sharded model holds)."""


@dataclass
class Inputs:
    """What an island trains on, pinned: the model source, data and provenance."""

    source: Any
    train: Any
    held_out: Any | None
    provenance: dict


# ---- the run ---------------------------------------------------------------------
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
    on_sync = _group(group).collective(lambda: evaluate(backend, cfg, inputs))
    island = make_island(cfg, _group(group).island_weights(weights), client, on_sync, clock)
    if group.leader:  # the guard before each optimizer step, where the backend has one
        island.guard_updates(getattr(backend, "guard_updates", None))
    log.info("%d trainable tensors, %d parameters (%s, %s); %d training blocks, "
             "%d loss tokens%s", len(weights.layout.specs), weights.layout.numel, cfg.tuning,
             backend.describe(), len(inputs.train), inputs.train.loss_tokens,
             f"; {group.world} ranks" if group.active else "")
    with GracefulStop(on_first=_stopping) as stop:
        try:
            island.start()
        except Refused as e:
            log.error("%s", e)
            return EXIT_NOT_FEDERATED
        group.share(True, weights)
        before = leader_eval(backend, cfg, inputs)
        write_metrics(cfg.output, dict(step=0, eval_loss=before, version=island.version,
                                       time=time.time()), group)
        tokens_per_s = train(cfg, backend, island, weights, inputs.train, stop)
        if group.leader:
            island.finish()
        group.share(True, weights)
        if cfg.output and group.active:  # every rank's final weights, for the record
            group.record_weights(cfg.output, "final", weights)
    after = leader_eval(backend, cfg, inputs, before)
    summary = summarize(island, client, group, before, after, tokens_per_s)
    if cfg.output and (group.leader or _group(group).sharded):
        save_outputs(cfg, backend, inputs, summary, group)
    code = exit_code(cfg, island, client)
    # the model goes before the process group it holds (FSDP): a group destroyed while
    # sharded tensors still use it made gloo abort the process at exit under load
    del island, weights, on_sync
    backend.release()
    gc.collect()
    group.close()
    return code


def _stopping(name: str) -> None:
    log.warning("%s: stopping after this step; finishing and saving (again to stop at once)",
                name)


def setup_logging(cfg: IslandConfig, group) -> None:
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


def make_island(cfg: IslandConfig, weights: Weights, client: Transport | None,
                on_sync, clock: Callable[[], float] = time.monotonic) -> Island:
    return Island(weights, client=client, sync_every=cfg.sync_every,
                  sync_every_seconds=cfg.sync_every_seconds, merge_alpha=cfg.merge_alpha,
                  pipeline=cfg.pipeline, wire=cfg.wire, blocking=cfg.blocking_sync,
                  on_sync=on_sync, clock=clock)


def _group(group):
    """`group`, or Solo's sharding hooks for a group that predates them."""
    return group if hasattr(group, "island_weights") else _Unsharded()


class _Unsharded(Solo):
    """The sharding hooks of a group without them (only these are used from it)."""


# ---- training ----------------------------------------------------------------------
def train(cfg: IslandConfig, backend: Backend, island: Island, weights: Weights, blocks,
          stop: GracefulStop) -> float:
    """The inner loop: one optimizer step per iteration, then the island's turn (apply
    arrived weights, push when due). In a torchrun group only rank 0's island talks to
    the syncer; merged weights reach the other ranks at the same step boundary.
    Returns the island's training tokens per second (all ranks together)."""
    from yeto.data import BatchSampler

    group = backend.group
    sampler = BatchSampler(blocks, cfg.batch_size, seed=cfg.seed + cfg.resolved_index())
    t0, seen = time.perf_counter(), 0
    live = LiveProgress(cfg.output)
    with progress(cfg, f"{cfg.learner_id} ({backend.name})", group.leader) as bar:
        for step in range(1, cfg.max_steps + 1):
            t_step = time.perf_counter()
            micro = [next(sampler) for _ in range(cfg.grad_accum)]
            loss, loss_tokens = backend.train_step(micro)
            seen += sum(mb[0].shape[0] * (mb[0].shape[1] - 1) for mb in micro)
            if cfg.slowdown > 1:  # a slower machine, simulated: stretch the step
                time.sleep((cfg.slowdown - 1) * (time.perf_counter() - t_step))
            # rank 0 decides when to stop (a signal, a non-finite loss), so every rank of
            # a torchrun group leaves at the same step: their collectives stay matched
            done = island_turn(cfg, island, group, weights, step, loss, loss_tokens, t0,
                               stopping=stop.is_set() or not math.isfinite(loss))
            bar(loss, seen / (time.perf_counter() - t0), island.version)
            if group.leader:
                live.step(island.step, loss)
            if not math.isfinite(loss) and group.leader:
                log.error("training loss is %s at step %d: lower --inner-lr", loss, island.step)
            if done:
                break
    return group.sum(seen) / (time.perf_counter() - t0)


def island_turn(cfg: IslandConfig, island: Island, group, weights: Weights, step: int,
                loss: float, loss_tokens: int, t0: float, stopping: bool = False) -> bool:
    """After one step: the island applies and pushes; ranks follow; metrics at syncs.
    Returns True when the run is over, or rank 0 is `stopping`."""
    loss_tokens = group.sum(loss_tokens)
    pushes, versions = island.pushes, dict(island.versions)
    done = island.after_step(loss_tokens, train_loss=loss) if group.leader else False
    done = done or (stopping and group.leader)
    if group.active:
        done, applied = group.share(island.versions != versions, weights, done)
        if applied and cfg.output:
            group.record_weights(cfg.output, step, weights)
    if island.pushes != pushes or (island.client is None and island.step % cfg.sync_every == 0):
        write_metrics(cfg.output, dict(
            step=island.step, train_loss=loss, eval_loss=island.eval_loss,
            version=island.version, loss_tokens=island.total_tokens,
            tokens_per_s=island.total_tokens / (time.perf_counter() - t0),
            time=time.time()), group)
    return done


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
        if _group(backend.group).sharded and inputs.held_out is not None:
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


def summarize(island: Island, client: Transport | None, group, before: float, after: float,
              tokens_per_s: float) -> dict:
    return dict(step=island.step, eval_loss=after, eval_loss_before=before,
                version=island.version, final=island.finished,
                loss_tokens=island.total_tokens, pushes=island.pushes,
                bytes_up=client.bytes_up if client else 0,
                bytes_down=client.bytes_down if client else 0,
                wait_s=client.wait_s if client else 0.0, ranks=group.world,
                tokens_per_s=tokens_per_s)


def save_outputs(cfg: IslandConfig, backend: Backend, inputs: Inputs, summary: dict,
                 group=Solo()) -> None:
    """Rank 0 saves the model and the run's records (every rank of a sharded group takes
    part in gathering the model)."""
    from yeto.data.provenance import write_provenance

    saved = backend.save(cfg, cfg.output)
    if not group.leader:
        return
    write_provenance(saved, inputs.provenance)
    write_metrics(cfg.output, summary)
    atomic_write(cfg.output / "summary.json", json.dumps(summary, indent=2))
    log.info("saved to %s", cfg.output)


def write_metrics(out: Path | None, record: dict, group=Solo()) -> None:
    """Append one JSON line to OUT/metrics.jsonl (rank 0 only)."""
    if out is None or not group.leader:
        return
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def exit_code(cfg: IslandConfig, island: Island, client: Transport | None) -> int:
    """Non-zero for a federated island that never joined a round: a run that never
    federated must not look like success (unless --allow-solo)."""
    if client is None or island.versions:  # single island, a non-leader rank, or joined
        return EXIT_OK
    why = client.fatal or client.last_error or "no answer"
    message = (f"this island never joined a round: the syncer at {cfg.syncer} was not "
               f"reached (last error: {why}). Check the address and that `python -m syncer` "
               "runs there")
    if cfg.allow_solo:
        log.warning("%s; it trained alone (--allow-solo)", message)
        return EXIT_OK
    log.error("%s; to train alone on purpose, pass --allow-solo", message)
    return EXIT_NOT_FEDERATED
