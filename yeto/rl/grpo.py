"""GRPO's arithmetic (torch): group-normalised advantages, the trainer's own
recomputation of completion logprobs, and the clipped policy loss.

For sample i of a group with rewards r: ``A_i = (r_i − mean r) / (std r + eps)``
(without ``scale``: ``r_i − mean r``, as Dr. GRPO). Per completion token t:

    ratio_t = exp(logp_θ(t) − logp_behaviour(t))      behaviour: the node's logprob
    loss_t  = −min(ratio_t·A, clip(ratio_t, 1−ε, 1+ε)·A) + β·KL_t
    KL_t    = exp(ref_t − logp_θ(t)) − (ref_t − logp_θ(t)) − 1   (k3, to the base model)

and the step's loss is the mean over all completion tokens of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


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


def _batch(seqs: list[Seq], pad_id: int, device):
    """Right-padded inputs (prompt + completion minus its last token), their mask, and
    for each completion token the input position that predicts it."""
    lengths = [len(s.prompt) + len(s.tokens) - 1 for s in seqs]
    width, t_max = max(lengths), max(len(s.tokens) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    pos = torch.zeros((len(seqs), t_max), dtype=torch.long)
    tgt = torch.zeros((len(seqs), t_max), dtype=torch.long)
    tmask = torch.zeros((len(seqs), t_max), dtype=torch.float32)
    for i, s in enumerate(seqs):
        full = list(s.prompt) + list(s.tokens[:-1])
        ids[i, :len(full)] = torch.tensor(full)
        mask[i, :len(full)] = 1
        n = len(s.tokens)
        pos[i, :n] = torch.arange(len(s.prompt) - 1, len(s.prompt) - 1 + n)
        tgt[i, :n] = torch.tensor(s.tokens)
        tmask[i, :n] = 1.0
    return ids.to(device), mask.to(device), pos.to(device), tgt.to(device), tmask.to(device)


def completion_logprobs(model, seqs: list[Seq], pad_id: int = 0, device="cpu"):
    """(logprobs (B, T), token mask (B, T)) of each completion token under `model`, in
    float32 (with grad when grad is enabled)."""
    ids, mask, pos, tgt, tmask = _batch(seqs, pad_id, device)
    logits = model(input_ids=ids, attention_mask=mask).logits
    picked = logits.gather(1, pos[:, :, None].expand(-1, -1, logits.shape[-1])).float()
    lp = torch.log_softmax(picked, dim=-1).gather(2, tgt[:, :, None])[:, :, 0]
    return lp * tmask, tmask


def policy_loss(new: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                clip_eps: float, kl_coef: float = 0.0, ref: torch.Tensor | None = None):
    """Σ over tokens of the clipped GRPO loss (divide by the batch's token count), and
    statistics: clipped share, mean ratio, mean KL (sums, with the token count)."""
    ratio = torch.exp(new - old)
    a = adv[:, None]
    per_tok = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * a)
    kl = torch.zeros_like(new)
    if kl_coef and ref is not None:
        d = ref - new
        kl = torch.exp(d) - d - 1
        per_tok = per_tok + kl_coef * kl
    clipped = ((ratio < 1 - clip_eps) | (ratio > 1 + clip_eps)).float()
    stats = dict(clipped=float((clipped * mask).sum()), ratio=float((ratio.detach() * mask).sum()),
                 kl=float((kl.detach() * mask).sum()))
    return (per_tok * mask).sum(), stats
