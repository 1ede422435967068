"""GRPO's arithmetic in torch, and the torch edge of the GRPO island (`TorchGRPO`):
the trainer's own recomputation of completion logprobs, the clipped policy loss, one
AdamW step, and the engine its held-out reward is sampled with. The MLX twin is
`yeto.mlx.grpo`; what both share (samples, advantages, batches) is `yeto.rl.seqs`.

Per completion token t:

    ratio_t = exp(logp_θ(t) − logp_behaviour(t))      behaviour: the node's logprob
    loss_t  = −min(ratio_t·A, clip(ratio_t, 1−ε, 1+ε)·A) + β·KL_t
    KL_t    = exp(ref_t − logp_θ(t)) − (ref_t − logp_θ(t)) − 1   (k3, to the base model)

and the step's loss is the mean over all completion tokens of the batch.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from yeto.rl.seqs import Seq, batch_of, group_advantages  # noqa: F401 - re-exported


def completion_logprobs(model, seqs: list[Seq], pad_id: int = 0, device="cpu"):
    """(logprobs (B, T), token mask (B, T)) of each completion token under `model`, in
    float32 (with grad when grad is enabled)."""
    b = batch_of(seqs, pad_id)
    ids, mask, pos, tgt, tmask = (torch.from_numpy(a).to(device)
                                  for a in (b.ids, b.mask, b.pos, b.tgt, b.tmask))
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


class TorchGRPO:
    """The torch edge of a GRPO island (`yeto.rl.trainer.Policy`), over the torch
    island's backend (`yeto.torch.learner.TorchBackend`: peft model, AdamW)."""

    name = "torch"

    def __init__(self, backend, clip_eps: float, kl_coef: float, model_dir):
        self.backend, self.clip_eps, self.kl_coef = backend, clip_eps, kl_coef
        self.model_dir = model_dir
        self.tokenizer = backend.tokenizer
        self.pad_id = self.tokenizer.pad_token_id or 0

    def zero_grad(self) -> None:
        self.backend.model.train()
        self.backend.opt.zero_grad(set_to_none=True)

    def backward(self, seqs: list[Seq], total: int) -> dict:
        """Add the gradient of (Σ loss over `seqs`' completion tokens) / `total`; returns
        sums over those tokens: loss, gap (|behaviour − recomputed|), clipped, ratio, kl."""
        model, device = self.backend.model, self.backend.device
        new, mask = completion_logprobs(model, seqs, self.pad_id, device)
        b = batch_of(seqs, self.pad_id)
        old = torch.from_numpy(b.behaviour).to(device)
        adv = torch.from_numpy(b.advantage).to(device)
        ref = None
        if self.kl_coef:
            with torch.no_grad(), model.disable_adapter():
                ref, _ = completion_logprobs(model, seqs, self.pad_id, device)
        loss, st = policy_loss(new, old, adv, mask, self.clip_eps, self.kl_coef, ref)
        (loss / total).backward()
        return dict(st, loss=float(loss.detach()),
                    gap=float(((new.detach() - old).abs() * mask).sum()))

    def grads(self) -> dict:
        """Canonical name -> the accumulated gradient (numpy), for checks."""
        from yeto.torch.weights import TorchWeights

        params = TorchWeights(self.backend.model, "lora").params
        return {n: p.grad.detach().cpu().numpy().copy() for n, p in params.items()
                if p.grad is not None}

    def step(self, lr_scale: float, max_grad_norm: float) -> None:
        """Clip the gradient's norm (0: no clipping) and take one AdamW step at the
        learning rate times `lr_scale`."""
        opt = self.backend.opt
        for group in opt.param_groups:
            group.setdefault("base_lr", group["lr"])
            group["lr"] = group["base_lr"] * lr_scale
        if max_grad_norm:
            params = [p for p in self.backend.model.parameters() if p.requires_grad]
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()

    @contextmanager
    def engine(self):
        """A rollout engine over the trainer's own weights (eval mode meanwhile)."""
        from yeto.rollout.torch_engine import TorchEngine

        model = self.backend.model
        was_training = model.training
        model.eval()
        try:
            yield TorchEngine.wrap(model, self.tokenizer, self.model_dir)
        finally:
            model.train(was_training)
