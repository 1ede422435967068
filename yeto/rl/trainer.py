"""The GRPO island: an island whose inner step samples from rollout nodes and trains
on rewards (`python -m yeto.rl`).

It is an ordinary island: the island machinery (`yeto.loop.IslandDriver` over
`yeto.island.Island`: join, push every H steps, apply merged Θ, finish) and the
backend (model, LoRA, AdamW, saving: `yeto.torch.learner.TorchBackend` or
`yeto.mlx.learner.MLXBackend`, `--backend`) are the SFT island's. Only the step
differs:

1. the next P prompts go to the rollout nodes, G completions each, groups whole
   and round-robined (`yeto.rl.pool`);
2. rewards, group-normalised advantages (`yeto.rl.seqs`);
3. the trainer recomputes each completion's logprobs on its own weights and takes
   one AdamW step on the clipped GRPO loss (groups whose rewards are all equal
   carry no signal and are skipped).

Everything here is backend-free; what a backend does (3., and the engine the
held-out completions are sampled with) is a `Policy`: `yeto.rl.grpo.TorchGRPO`,
`yeto.mlx.grpo.MLXGRPO`.

Per step it logs (OUT/metrics.jsonl) the reward, the staleness of the samples (its
version − the ``yeto_version`` that sampled them) and the mean |behaviour −
recomputed| logprob gap. Held-out reward is measured greedily on the trainer's own
weights, in process, never through a rollout node: before training, at every sync
and at the end.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from yeto.rl import overlap
from yeto.rl.pool import RolloutPool
from yeto.rl.prompts import Prompt
from yeto.rl.seqs import Seq, group_advantages, warmup_scale

log = logging.getLogger("yeto.island")


@dataclass
class RLConfig:
    """The GRPO island's settings beyond `yeto.config.IslandConfig`'s."""

    rollout_url: list[str]
    reward: list[str]
    backend: str = "torch"                 # torch | mlx: the island's tensor engine
    group_size: int = 8
    prompts_per_step: int = 8
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    scale_rewards: bool = True
    adapter: Path | None = None
    micro_batch: int = 64
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    eval_reward: list[str] | None = None   # None: the training reward
    eval_prompts: int = 64
    rollout_timeout: float = 300.0
    rollout_wait: float = 600.0
    rollout_api_key: str | None = None
    rollout_model: str | None = None
    update_nodes: bool = False             # keep the nodes current (yeto.rl.direct)
    node_adapter_dir: Path | None = None   # where; None: OUTPUT/node-adapters
    async_rollouts: bool = False           # draw step t+1's batch while t trains (overlap)
    max_staleness: int | None = None       # drop batches staler than this (None: keep all)


class Policy(Protocol):
    """The backend's part of a GRPO step and of its held-out evaluation
    (`yeto.rl.grpo.TorchGRPO`, `yeto.mlx.grpo.MLXGRPO`)."""

    name: str
    tokenizer: Any

    def zero_grad(self) -> None: ...

    def backward(self, seqs: list[Seq], total: int) -> dict:
        """Recompute `seqs`' completion logprobs on the trainer's weights and add the
        gradient of their GRPO loss / `total`; returns sums over their completion tokens
        of loss, gap (|behaviour − recomputed|), clipped, ratio and kl."""

    def step(self, lr_scale: float, max_grad_norm: float) -> None:
        """Clip the gradient's norm (0: no clipping), one AdamW step at lr × lr_scale."""

    def engine(self) -> AbstractContextManager:
        """A `yeto.rollout.generate.Engine` over the trainer's own weights."""


def evaluate_reward(engine, tokenizer, prompts: list[Prompt], reward, max_new: int, eos_ids,
                    batch: int = 64) -> float:
    """Mean reward of greedy completions of `prompts` by `engine` (in process)."""
    from yeto.rollout.generate import Row, SamplingParams, generate

    if not prompts:
        return float("nan")
    params = SamplingParams(max_tokens=max_new, temperature=0.0)
    detok = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    scores = []
    for lo in range(0, len(prompts), batch):
        chunk = prompts[lo:lo + batch]
        rows = [Row(p.ids, params, np.random.default_rng(0)) for p in chunk]
        for p, o in zip(chunk, generate(engine, rows, eos_ids, detok)):
            scores.append(float(reward(o.text, reference=p.reference, prompt=p.text)))
    return float(np.mean(scores))


class GRPOTrainer:
    """The step and the evaluation of a GRPO island (the syncing is `Island`'s)."""

    def __init__(self, rl: RLConfig, policy: Policy, prompts: list[Prompt],
                 held_out: list[Prompt], reward, pool: RolloutPool, eos_ids, seed: int = 0):
        self.rl, self.policy, self.pool = rl, policy, pool
        self.prompts, self.held_out, self.reward = prompts, held_out, reward
        self.eos_ids, self.seed = list(eos_ids), seed
        self.eval_fn = reward  # the held-out metric (`RLConfig.eval_reward`, else `reward`)
        self.rng = np.random.default_rng(seed)
        self._order: list[int] = []
        self.eval_reward = float("nan")
        self.evals = 0
        self.sampler = overlap.sampler_for(rl, pool, self._next_prompts, seed)

    def evaluate(self) -> float:
        with self.policy.engine() as engine:
            self.eval_reward = evaluate_reward(engine, self.policy.tokenizer, self.held_out,
                                               self.eval_fn, self.rl.max_new_tokens,
                                               self.eos_ids)
        self.evals += 1
        return self.eval_reward

    def on_sync(self) -> float:
        """Island's hook at every sync: the held-out reward, logged; NaN goes to the
        syncer as eval loss (a reward is not a loss)."""
        log.info("held-out reward %.4f (greedy, own weights)", self.evaluate())
        return float("nan")

    def _next_prompts(self) -> list[Prompt]:
        out = []
        while len(out) < self.rl.prompts_per_step:
            if not self._order:
                self._order = list(self.rng.permutation(len(self.prompts)))
            out.append(self.prompts[self._order.pop()])
        return out

    def step(self, step: int, version: int) -> dict:
        """One GRPO step: sample, score, train. Returns its metrics."""
        rl = self.rl
        drawn, fetch = self.sampler.take(step, version)  # drawn now, or ahead (yeto.rl.overlap)
        batch, groups, t_roll = drawn.prompts, drawn.groups, drawn.seconds
        rewards = np.array([[float(self.reward(s.text, reference=p.reference, prompt=p.text))
                             for s in g] for p, g in zip(batch, groups)])
        adv = group_advantages(rewards, rl.scale_rewards)
        seqs = [Seq(p.ids, s.token_ids, s.logprobs, float(adv[i, j]), s.version)
                for i, (p, g) in enumerate(zip(batch, groups)) for j, s in enumerate(g)]
        trained = [s for s in seqs if abs(s.advantage) > 1e-8]
        t1 = time.perf_counter()
        stats = self._train(trained, step) if trained else dict(loss=0.0, tokens=0)
        # staleness: commits between the sampling weights and the trainer's (in a run)
        seen = [version - s.version for s in seqs if s.version >= 0 <= version]
        return dict(step=step, reward=float(rewards.mean()), reward_std=float(rewards.std()),
                    groups_trained=int(sum(np.abs(adv).max(axis=1) > 1e-8)),
                    staleness=float(np.mean(seen)) if seen else None,
                    staleness_max=int(max(seen)) if seen else None,
                    sample_versions=sorted({s.version for s in seqs}),
                    completion_len=float(np.mean([len(s.tokens) for s in seqs])),
                    rollout_s=round(t_roll, 3), train_s=round(time.perf_counter() - t1, 3),
                    **fetch, **stats)

    def _train(self, seqs: list[Seq], step: int) -> dict:
        """One AdamW step on the GRPO loss of `seqs` (micro-batched), the loss being the
        mean over all their completion tokens; returns the step's means per token."""
        rl, policy = self.rl, self.policy
        total = sum(len(s.tokens) for s in seqs)
        policy.zero_grad()
        acc = dict.fromkeys(("loss", "gap", "clipped", "ratio", "kl"), 0.0)
        for lo in range(0, len(seqs), rl.micro_batch):
            st = policy.backward(seqs[lo:lo + rl.micro_batch], total)
            for k in acc:
                acc[k] += st[k]
        policy.step(warmup_scale(step, rl.warmup_steps), rl.max_grad_norm)
        out = {("logprob_gap" if k == "gap" else k): v / total for k, v in acc.items()}
        return dict(out, tokens=total)


def finite(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None
