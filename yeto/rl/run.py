"""`run_grpo(cfg, rl)`: a GRPO island from start to end, on the island machinery.

The pieces are the SFT island's (`yeto.loop`): logging, the gRPC client
(`make_client`), the island driver (`IslandDriver`: join, pushes every H steps,
merged Θ applied at step boundaries, finish, final weights, the metrics file), the
clean stop on SIGINT/SIGTERM, and the exit codes; the model, LoRA, optimizer and
saving are the island backend's (`--backend`, `yeto.backends`:
`yeto.torch.learner.TorchBackend`, or `yeto.mlx.learner.MLXBackend`, which imports
no torch). The step is `GRPOTrainer.step`, its backend part a
`yeto.rl.trainer.Policy`; its metrics line is written every step.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from yeto.config import IslandConfig
from yeto.loop import (
    EXIT_BAD_INPUT,
    EXIT_NOT_FEDERATED,
    IslandDriver,
    Solo,
    make_client,
    setup_logging,
)
from yeto.rl.overlap import StaleRollouts
from yeto.rl.pool import NoNodes
from yeto.rl.trainer import GRPOTrainer, RLConfig, finite
from yeto.signals import GracefulStop
from yeto.transport import Refused

log = logging.getLogger("yeto.island")

EXIT_NO_ROLLOUTS = 4  # no rollout node answered for --rollout-wait seconds


@dataclass
class Parts:
    backend: object
    weights: object
    trainer: GRPOTrainer
    provenance: dict
    updater: object = None  # yeto.rl.direct.NodeUpdater with --update-nodes


def prepare(cfg: IslandConfig, rl: RLConfig) -> Parts:
    """Model (+ --adapter), LoRA, optimizer, prompts, rewards and the node pool."""
    from yeto.data.models import resolve_model
    from yeto.data.provenance import build_record, write_provenance
    from yeto.rl.pool import RolloutPool
    from yeto.rl.prompts import load_prompts
    from yeto.rl.rewards import combine, load_reward
    from yeto.rollout.adapters import flat_of, read_adapter
    from yeto.rollout.engine import stop_token_ids

    reward = combine([load_reward(s) for s in rl.reward or ["reversal_accuracy"]])
    source = resolve_model(cfg.model, cfg.model_revision, cfg.trust_remote_code)
    backend = island_backend(cfg, rl)
    tok = backend.load(cfg, source)
    tensors = None
    if rl.adapter is not None:  # start from an adapter: its LoRA shape and weights
        tensors, spec, _ = read_adapter(rl.adapter, source.path)
        cfg.lora_r, cfg.lora_alpha, cfg.lora_targets = spec.r, spec.alpha, spec.targets
    weights = backend.attach(cfg)
    if tensors is not None:
        weights.set(flat_of(tensors, weights.layout))
    prompts, data_rec = load_prompts(cfg.data, tok, cfg.shard, revision=cfg.data_revision,
                                     split=cfg.data_split)
    held_out, eval_rec = [], None
    if cfg.eval_data:
        held_out, eval_rec = load_prompts(cfg.eval_data, tok, revision=cfg.eval_data_revision,
                                          split=cfg.eval_split, held_out=True)
        held_out = held_out[:rl.eval_prompts] if rl.eval_prompts else held_out
    pool = RolloutPool(rl.rollout_url, timeout_s=rl.rollout_timeout, wait_s=rl.rollout_wait,
                       api_key=rl.rollout_api_key, model=rl.rollout_model)
    trainer = GRPOTrainer(rl, policy_of(rl, backend, source.path), prompts, held_out,
                          reward, pool, stop_token_ids(source.path, tok), cfg.seed)
    if rl.eval_reward:
        trainer.eval_fn = combine([load_reward(s) for s in rl.eval_reward])
    record = build_record(source, data_rec, cfg, backend=f"{rl.backend}-grpo",
                          eval_data=eval_rec)
    if cfg.output:
        write_provenance(cfg.output, record)
    return Parts(backend, weights, trainer, record, _updater(cfg, rl, backend, pool))


def island_backend(cfg: IslandConfig, rl: RLConfig):
    """The SFT island's backend of `rl.backend`: model, LoRA, AdamW, saving."""
    from yeto.backends import BACKENDS

    return BACKENDS[rl.backend].backend_class()(cfg)


def policy_of(rl: RLConfig, backend, model_dir):
    """The backend's part of the GRPO step (`yeto.rl.trainer.Policy`)."""
    from yeto.backends import BACKENDS

    return BACKENDS[rl.backend].grpo_class()(backend, rl.clip_eps, rl.kl_coef, model_dir)


def _updater(cfg: IslandConfig, rl: RLConfig, backend, pool):
    if not rl.update_nodes:
        return None
    from yeto.rl.direct import NodeUpdater

    folder = rl.node_adapter_dir or (cfg.output / "node-adapters" if cfg.output else None)
    if folder is None:
        raise ValueError("--update-nodes needs --node-adapter-dir or --output: a folder the "
                         "rollout nodes read the trainer's adapters from")
    return NodeUpdater(pool, folder, lambda path: backend.save(cfg, path))


def run_grpo(cfg: IslandConfig, rl: RLConfig) -> int:
    """Run one GRPO island to the end; returns the process exit code."""
    setup_logging(cfg, Solo())
    t_start = time.monotonic()
    try:
        parts = prepare(cfg, rl)
    except (OSError, ValueError) as e:  # missing files, bad data, bad reward or adapter
        log.error("%s", e)
        return EXIT_BAD_INPUT
    trainer, weights = parts.trainer, parts.weights
    client = make_client(cfg, weights.layout, parts.backend, regime="rl")
    driver = IslandDriver.for_config(cfg, weights, client, on_sync=trainer.on_sync,
                                     sync_lines=False)
    log.info("GRPO island: %d prompts, G=%d x %d prompts per step, %d nodes, %d LoRA "
             "parameters", len(trainer.prompts), rl.group_size, rl.prompts_per_step,
             len(trainer.pool.nodes), weights.layout.numel)
    with GracefulStop(on_first=lambda n: log.warning("%s: stopping after this step", n)) as stop:
        try:
            driver.start()
        except Refused as e:
            log.error("%s", e)
            return EXIT_NOT_FEDERATED
        if parts.updater is not None:
            parts.updater.update(0)  # the nodes start from the trainer's weights
        before = trainer.evaluate()
        log.info("held-out reward before training: %.4f", before)
        driver.begin(eval_reward=finite(before))
        history, failure = train(cfg, trainer, driver, stop, parts.updater)
        driver.finish()
    after = trainer.evaluate()
    log.info("held-out reward after training: %.4f (before %.4f)", after, before)
    summary = summarize(cfg, rl, driver, trainer, history, before, after, t_start)
    if cfg.output:
        save(cfg, parts, summary)
    trainer.sampler.close()
    trainer.pool.close()
    driver.close()
    if failure:
        return EXIT_NO_ROLLOUTS
    return driver.exit_code(cfg.syncer, cfg.allow_solo)


def train(cfg: IslandConfig, trainer: GRPOTrainer, driver: IslandDriver, stop, updater=None
          ) -> tuple[list[dict], str]:
    """The inner loop: a GRPO step, then the island's turn (apply merged Θ, push when
    due, which evaluates), then with --update-nodes the nodes' weights; one metrics line
    per step. Returns the metrics and, when no rollout node answered (the run then ends
    early, its work kept), why."""
    history = []
    trainer.sampler.last_step = cfg.max_steps  # --async-rollouts: no draw past the end
    for step in range(1, cfg.max_steps + 1):
        try:
            # staleness counts versions of the sampling weights: Θ's commits for nodes
            # that observe the syncer, the trainer's updates for nodes it keeps current
            m = trainer.step(step, driver.version if updater is None else updater.updates)
            done = driver.step(m["tokens"], m["loss"], stopping=stop.is_set())
            if updater is not None and step % cfg.sync_every == 0 and step < cfg.max_steps \
                    and not done:
                updater.update(step)  # the weights as of now: merged Θ included
        except (NoNodes, StaleRollouts) as e:
            log.error("%s; stopping: what was trained is saved", e)
            return history, str(e)
        m.update(version=driver.version, eval_reward=finite(trainer.eval_reward),
                 pushes=driver.island.pushes, time=time.time())
        if updater is not None:  # how many trainer updates each node is behind
            m["node_lag"] = {n.url: n.wanted - n.served for n in trainer.pool.nodes}
        driver.write(m)
        history.append(m)
        log.info("step %d: reward %.3f, staleness %s, logprob gap %.2e, loss %.4f, version %d",
                 step, m["reward"], m["staleness"], m.get("logprob_gap", 0.0), m["loss"],
                 driver.version)
        if done:
            break
    return history, ""


def summarize(cfg: IslandConfig, rl: RLConfig, driver: IslandDriver, trainer: GRPOTrainer,
              history: list[dict], before: float, after: float, t_start: float) -> dict:
    island, client = driver.island, driver.client
    stale = [m["staleness"] for m in history if m["staleness"] is not None]
    gaps = [m["logprob_gap"] for m in history if "logprob_gap" in m]
    return dict(
        reward_before=finite(before), reward_after=finite(after), steps=island.step,
        sync_every=cfg.sync_every if client is not None else None, version=island.version,
        final=island.finished, pushes=island.pushes, evals=trainer.evals,
        eval_prompts=len(trainer.held_out), eval_via="trainer (greedy, own weights)",
        reward=getattr(trainer.reward, "__name__", "reward"),
        eval_metric=getattr(trainer.eval_fn, "__name__", "reward"),
        group_size=rl.group_size, prompts_per_step=rl.prompts_per_step,
        staleness_mean=sum(stale) / len(stale) if stale else None,
        logprob_gap_mean=sum(gaps) / len(gaps) if gaps else None,
        stale_dropped=trainer.sampler.dropped, async_rollouts=rl.async_rollouts,
        train_reward_first=history[0]["reward"] if history else None,
        train_reward_last=history[-1]["reward"] if history else None,
        nodes=trainer.pool.report(), bytes_up=client.bytes_up if client else 0,
        bytes_down=client.bytes_down if client else 0,
        seconds=round(time.monotonic() - t_start, 1))


def save(cfg: IslandConfig, parts: Parts, summary: dict) -> None:
    from yeto.data.provenance import write_provenance
    from yeto.io import atomic_write

    saved = parts.backend.save(cfg, cfg.output)
    write_provenance(saved, parts.provenance)
    atomic_write(cfg.output / "summary.json", json.dumps(summary, indent=2))
    log.info("saved to %s", cfg.output)
