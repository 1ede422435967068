"""What a GRPO step trains on, backend-free (numpy): the sampled completions
(`Seq`), their group-normalised advantages, and the padded arrays both backends
recompute completion logprobs from (`yeto.rl.grpo` for torch, `yeto.mlx.grpo` for
MLX).

For sample i of a group with rewards r: ``A_i = (r_i − mean r) / (std r + eps)``
(without ``scale``: ``r_i − mean r``, as Dr. GRPO).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Seq:
    """One sampled completion to train on."""

    prompt: tuple[int, ...]
    tokens: list[int]
    behaviour: list[float]     # the node's logprob of each token
    advantage: float
    version: int               # the weights version that sampled it (-1: unknown)


def group_advantages(rewards: np.ndarray, scale: bool = True, eps: float = 1e-4) -> np.ndarray:
    """(prompts, G) rewards -> advantages, normalised within each group."""
    r = np.asarray(rewards, dtype=np.float64)
    adv = r - r.mean(axis=1, keepdims=True)
    if scale:
        adv = adv / (r.std(axis=1, keepdims=True) + eps)
    return adv


@dataclass
class Batch:
    """Right-padded inputs of a micro-batch of `Seq`s, as numpy arrays.

    ids (B, W): prompt + completion minus its last token, padded with the pad id;
    mask (B, W): 1 on real tokens; pos (B, T): for each completion token, the input
    position whose logits predict it; tgt (B, T): the completion tokens; tmask (B, T):
    1 on real completion tokens; behaviour (B, T): the node's logprobs (0 on padding);
    advantage (B,)."""

    ids: np.ndarray
    mask: np.ndarray
    pos: np.ndarray
    tgt: np.ndarray
    tmask: np.ndarray
    behaviour: np.ndarray
    advantage: np.ndarray


def batch_of(seqs: list[Seq], pad_id: int) -> Batch:
    lengths = [len(s.prompt) + len(s.tokens) - 1 for s in seqs]
    width, t_max = max(lengths), max(len(s.tokens) for s in seqs)
    b = Batch(ids=np.full((len(seqs), width), pad_id, dtype=np.int64),
              mask=np.zeros((len(seqs), width), dtype=np.int64),
              pos=np.zeros((len(seqs), t_max), dtype=np.int64),
              tgt=np.zeros((len(seqs), t_max), dtype=np.int64),
              tmask=np.zeros((len(seqs), t_max), dtype=np.float32),
              behaviour=np.zeros((len(seqs), t_max), dtype=np.float32),
              advantage=np.array([s.advantage for s in seqs], dtype=np.float32))
    for i, s in enumerate(seqs):
        full = list(s.prompt) + list(s.tokens[:-1])
        n = len(s.tokens)
        b.ids[i, :len(full)] = full
        b.mask[i, :len(full)] = 1
        b.pos[i, :n] = np.arange(len(s.prompt) - 1, len(s.prompt) - 1 + n)
        b.tgt[i, :n] = s.tokens
        b.tmask[i, :n] = 1.0
        b.behaviour[i, :len(s.behaviour)] = s.behaviour
    return b


def warmup_scale(step: int, warmup_steps: int) -> float:
    """The learning rate's factor at `step` (1-based): linear over the first
    `warmup_steps` steps, then 1 (AdamW's first steps are noisy)."""
    return min(1.0, step / max(1, warmup_steps))
