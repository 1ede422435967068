"""The cadence part of scripts/bench_rollout.py: GRPO runs in this process, the rollout
node's weights refreshed every H steps, sampled synchronously or one step ahead.

One arm = (cadence H, mode, seed). Its run, all in this process:

- the GRPO trainer is the island's (`yeto.rl.run.prepare`: model, the warm-start
  LoRA, AdamW, prompts, rewards, the rollout pool, `GRPOTrainer.step` with its
  sampler, `yeto.rl.overlap`), without a syncer;
- the samples come through yeto's real sampling path: `yeto.rl.pool.RolloutPool`,
  HTTP on loopback, a `yeto.rollout.server.RolloutNode` (its scheduler and torch
  engine, as `python -m yeto.rollout` runs them);
- cadence: every H steps the trainer's LoRA weights are offered to the node as the
  next version (`Scheduler.offer`, what an observer node does with each Θ the syncer
  commits) and the trainer's version becomes that version; "never": the node keeps
  the warm start and the version stays 0;
- mode "sync" draws each step's batch when the step starts; "async" draws step t+1's
  while step t trains (`--async-rollouts`), dropping batches more than
  `max_staleness` versions behind.

Measured per run: held-out reward (greedy reversal accuracy on the trainer's own
weights, 0 to 1) before and after, the training reward (sampled, mean of the last 10
steps minus the first 10), wall time of the GRPO steps, staleness in versions
(what `--max-staleness` bounds) and in trainer steps (optimizer updates between the
weights that sampled and the weights that train), how long the trainer waited for each
step's batch against how long drawing it took (async: the part not hidden behind
training), the behaviour-recomputed logprob gap,
batches dropped as stale. Each run's result is cached as JSON under OUT/cadence/, keyed
by its configuration, so an interrupted benchmark resumes.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from pathlib import Path

CACHE_VERSION = 1


def arm_config(args, cadence: str, mode: str, seed: int) -> dict:
    """Everything that changes an arm's result (the cache key)."""
    return dict(v=CACHE_VERSION, cadence=cadence, mode=mode, seed=seed, steps=args.steps,
                group_size=args.group_size, prompts_per_step=args.prompts_per_step,
                max_new_tokens=args.cadence_max_tokens, temperature=args.temperature,
                inner_lr=args.inner_lr, warmup_steps=args.warmup_steps,
                sft_steps=args.sft_steps, eval_prompts=args.eval_prompts,
                max_staleness=args.max_staleness if mode == "async" else None,
                reward=args.reward)


def cached_arm(args, cadence: str, mode: str, seed: int, model: Path, adapter,
               data) -> dict | None:
    """The arm's cached result, else its run (None with --cached-only)."""
    from yeto.io import atomic_write

    cfg = arm_config(args, cadence, mode, seed)
    digest = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]
    path = args.out / "cadence" / f"{cadence}-{mode}-seed{seed}-{digest}.json"
    if path.is_file() and not args.fresh:
        return json.loads(path.read_text())["result"]
    if args.cached_only:
        return None
    print(f"  running: every {cadence}, {mode}, seed {seed} ...", flush=True)
    res = run_arm(args, cfg, model, adapter(seed), data)
    print(f"    held-out {res['reward_before']:.3f} -> {res['reward_after']:.3f}, "
          f"{res['seconds']:.0f} s, staleness {res['staleness_mean']:.2f} versions / "
          f"{res['lag_steps_mean']:.2f} steps, dropped {res['stale_dropped']}", flush=True)
    atomic_write(path, json.dumps(dict(config=cfg, result=res), indent=1))
    return res


def _node(model: Path, adapter: Path):
    from yeto.rollout.engine import stop_token_ids
    from yeto.rollout.server import RolloutNode, serve_in_thread
    from yeto.rollout.torch_engine import TorchEngine

    engine = TorchEngine(model)
    engine.load_adapter(adapter)
    node = RolloutNode(engine, model_name="bench",
                       eos_ids=stop_token_ids(model, engine.tokenizer))
    server, url = serve_in_thread(node)
    return node, server, url


def _trainer(cfg: dict, model: Path, adapter: Path, data, url: str):
    from yeto.config import IslandConfig
    from yeto.rl.run import prepare
    from yeto.rl.trainer import RLConfig

    island = IslandConfig(model=str(model), data=str(data[0]), eval_data=str(data[1]),
                          inner_lr=cfg["inner_lr"], threads=1, device="cpu", seed=cfg["seed"],
                          max_steps=cfg["steps"]).check()
    rl = RLConfig(rollout_url=[url + "/v1"], reward=cfg["reward"].split(","),
                  group_size=cfg["group_size"], prompts_per_step=cfg["prompts_per_step"],
                  max_new_tokens=cfg["max_new_tokens"], temperature=cfg["temperature"],
                  adapter=adapter, warmup_steps=cfg["warmup_steps"],
                  eval_reward=["reversal_accuracy"], eval_prompts=cfg["eval_prompts"],
                  async_rollouts=cfg["mode"] == "async", max_staleness=cfg["max_staleness"],
                  rollout_wait=120.0, rollout_timeout=120.0)
    return prepare(island, rl)


def run_arm(args, cfg: dict, model: Path, adapter: Path, data) -> dict:
    """One GRPO run (see the module's doc string); returns its measurements."""
    import torch

    torch.set_num_threads(1)  # the trainer and the node's engine: a core each
    node, server, url = _node(model, adapter)
    parts = _trainer(cfg, model, adapter, data, url)
    trainer, weights = parts.trainer, parts.weights
    if weights.layout.fingerprint != node.engine.layout.fingerprint:
        raise RuntimeError("the node's LoRA layout is not the trainer's")
    every = None if cfg["cadence"] == "never" else int(cfg["cadence"])
    node.scheduler.version = version = 0
    published = {0: 0}  # version -> the trainer step whose weights it is
    history = []
    trainer.sampler.last_step = cfg["steps"]
    try:
        before = trainer.evaluate()
        t0 = time.perf_counter()
        for step in range(1, cfg["steps"] + 1):
            m = trainer.step(step, version)
            m["lag_steps"] = [step - 1 - published[v] for v in m["sample_versions"]]
            history.append(m)
            if getattr(args, "trace", False) and step % 10 == 0:
                print(f"    step {step}: train reward {m['reward']:.3f}, length "
                      f"{m['completion_len']:.1f}, groups {m['groups_trained']}", flush=True)
            if every and step % every == 0 and step < cfg["steps"]:
                version += 1
                published[version] = step
                node.scheduler.offer(weights.get().copy(), version)
        seconds = time.perf_counter() - t0
        after = trainer.evaluate()
    finally:
        trainer.sampler.close()
        trainer.pool.close()
        server.shutdown()
        server.server_close()
        node.close()
    return summarize(history, before, after, seconds)


def summarize(history: list[dict], before: float, after: float, seconds: float) -> dict:
    def mean(key):
        xs = [m[key] for m in history if m.get(key) is not None]
        return statistics.fmean(xs) if xs else float("nan")

    lags = [statistics.fmean(m["lag_steps"]) for m in history if m["lag_steps"]]
    return dict(reward_before=before, reward_after=after, seconds=seconds, steps=len(history),
                staleness_mean=mean("staleness"), logprob_gap_mean=mean("logprob_gap"),
                lag_steps_mean=statistics.fmean(lags) if lags else float("nan"),
                stale_dropped=sum(m.get("stale_dropped", 0) for m in history),
                rollout_wait_mean=mean("rollout_wait_s"), rollout_mean=mean("rollout_s"),
                train_mean=mean("train_s"),
                train_reward_first10=statistics.fmean(m["reward"] for m in history[:10]),
                train_reward_last10=statistics.fmean(m["reward"] for m in history[-10:]))


def _ms(xs: list[float], fmt: str = "{:.3f}") -> str:
    """mean ± sample standard deviation over seeds."""
    if len(xs) < 2:
        return fmt.format(statistics.fmean(xs))
    spread = fmt.replace("+", "").format(statistics.stdev(xs))
    return f"{fmt.format(statistics.fmean(xs))} ± {spread}"


def table(args, model: Path, adapter, data, seeds: list[int]) -> tuple[list, list, dict]:
    """Every (cadence, mode) arm over `seeds` (`adapter(seed)`: its warm start, made
    only for an arm not cached): the table's rows, headers and RESULT keys."""
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    cadences = [c.strip() for c in args.cadences.split(",") if c.strip()]
    done = {}  # the modes of one (cadence, seed) run one after the other: similar load
    for cadence in cadences:
        for s in seeds:
            for mode in modes:
                done[cadence, mode, s] = cached_arm(args, cadence, mode, s, model, adapter, data)
    return rows_of(args, {k: v for k, v in done.items() if v is not None}, cadences, modes,
                   seeds)


def rows_of(args, done: dict, cadences: list, modes: list, seeds: list) -> tuple:
    rows, kv = [], {}
    for cadence in cadences:
        for mode in modes:
            runs = [done[cadence, mode, s] for s in seeds if (cadence, mode, s) in done]
            if not runs:
                continue
            before = [r["reward_before"] for r in runs]
            after = [r["reward_after"] for r in runs]
            change = [a - b for a, b in zip(after, before)]
            label = "never" if cadence == "never" else f"every {cadence}"
            rows.append([label, mode if mode == "sync" else f"async (≤{args.max_staleness})",
                         len(runs),
                         _ms(before), _ms(after), _ms(change, "{:+.3f}"),
                         _ms([r["train_reward_last10"] - r["train_reward_first10"]
                              for r in runs], "{:+.3f}"),
                         _ms([r["seconds"] for r in runs], "{:.0f}"),
                         f"{statistics.fmean(r['rollout_wait_mean'] for r in runs):.2f} / "
                         f"{statistics.fmean(r['rollout_mean'] for r in runs):.2f}",
                         f"{statistics.fmean(r['staleness_mean'] for r in runs):.2f}",
                         f"{statistics.fmean(r['lag_steps_mean'] for r in runs):.2f}",
                         f"{statistics.fmean(r['logprob_gap_mean'] for r in runs):.2g}",
                         sum(r["stale_dropped"] for r in runs)])
            kv[f"change_{cadence}_{mode}"] = statistics.fmean(change)
    headers = ["weights to node", "sampling", "seeds", "held-out before", "after", "change",
               "train reward change", "GRPO time (s)", "waited / sampled (s per step)",
               "staleness (versions)", "lag (steps)",
               "|logprob gap| (nats/token)", "dropped"]
    return rows, headers, kv
