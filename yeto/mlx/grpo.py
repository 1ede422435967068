"""The MLX edge of the GRPO island (`python -m yeto.rl --backend mlx`): the MLX
twin of `yeto.rl.grpo` (torch), the same objective to float rounding
(tests/integration/test_rl_parity.py):

    ratio_t = exp(logp_θ(t) − logp_behaviour(t))      behaviour: the node's logprob
    loss_t  = −min(ratio_t·A, clip(ratio_t, 1−ε, 1+ε)·A) + β·KL_t
    KL_t    = exp(ref_t − logp_θ(t)) − (ref_t − logp_θ(t)) − 1   (k3, to the base model:
                                                     the LoRA layers taken out)

`MLXGRPO` recomputes completion logprobs on the MLX island's model
(`yeto.mlx.learner.MLXBackend`: peft-shaped LoRA, torch's AdamW settings), clips the
gradient norm as torch does, steps, and samples its held-out completions with the
MLX rollout engine (`yeto.rollout.mlx_engine`) over its own weights. Imports no
torch.
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx.optimizers import clip_grad_norm
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from yeto.rl.seqs import Seq, batch_of


def completion_logprobs(model, ids: mx.array, pos: mx.array, tgt: mx.array,
                        tmask: mx.array) -> mx.array:
    """Logprobs (B, T) of each completion token under `model`, float32, 0 on padding.
    Inputs are right-padded (`yeto.rl.seqs.Batch`): under the causal mask no real
    position sees a pad, so no attention mask is needed."""
    logits = model(ids)
    picked = logits[mx.arange(ids.shape[0])[:, None], pos].astype(mx.float32)  # (B, T, V)
    lp = mx.take_along_axis(picked, tgt[:, :, None], axis=-1)[:, :, 0]
    return (lp - mx.logsumexp(picked, axis=-1)) * tmask


def policy_loss(new: mx.array, old: mx.array, adv: mx.array, mask: mx.array, clip_eps: float,
                kl_coef: float = 0.0, ref: mx.array | None = None):
    """Σ over tokens of the clipped GRPO loss, and the sums of its statistics (clipped,
    ratio, kl; no gradient) -- `yeto.rl.grpo.policy_loss` in MLX."""
    ratio = mx.exp(new - old)
    a = adv[:, None]
    per_tok = -mx.minimum(ratio * a, mx.clip(ratio, 1 - clip_eps, 1 + clip_eps) * a)
    kl = mx.zeros_like(new)
    if kl_coef and ref is not None:
        d = ref - new
        kl = mx.exp(d) - d - 1
        per_tok = per_tok + kl_coef * kl
    clipped = ((ratio < 1 - clip_eps) | (ratio > 1 + clip_eps)).astype(mx.float32)
    sg = mx.stop_gradient
    stats = dict(clipped=(clipped * mask).sum(), ratio=(sg(ratio) * mask).sum(),
                 kl=(sg(kl) * mask).sum())
    return (per_tok * mask).sum(), stats


@contextmanager
def adapter_disabled(model, layers: dict):
    """`model` without its LoRA (the base model: the KL reference), as peft's
    ``disable_adapter()``: each `LoRALinear` swapped for its base linear meanwhile."""
    model.update_modules(tree_unflatten([(p, layer.base_layer) for p, layer in layers.items()]))
    try:
        yield model
    finally:
        model.update_modules(tree_unflatten(list(layers.items())))


class MLXGRPO:
    """The MLX edge of a GRPO island (`yeto.rl.trainer.Policy`), over the MLX island's
    backend (`yeto.mlx.learner.MLXBackend`)."""

    name = "mlx"

    def __init__(self, backend, clip_eps: float, kl_coef: float, model_dir):
        self.backend, self.tokenizer = backend, backend.tokenizer
        self.clip_eps, self.kl_coef, self.model_dir = clip_eps, kl_coef, model_dir
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.base_lr = float(backend.opt.learning_rate)
        self._grads = None
        self._value_and_grad = nn.value_and_grad(backend.model, self._loss)

    def _loss(self, ids, pos, tgt, tmask, old, adv, ref, total):
        new = completion_logprobs(self.backend.model, ids, pos, tgt, tmask)
        loss, stats = policy_loss(new, old, adv, tmask, self.clip_eps, self.kl_coef, ref)
        gap = (mx.abs(mx.stop_gradient(new) - old) * tmask).sum()
        return loss / total, mx.stop_gradient(loss), gap, stats

    def zero_grad(self) -> None:
        self._grads = None

    def backward(self, seqs: list[Seq], total: int) -> dict:
        """Add the gradient of (Σ loss over `seqs`' completion tokens) / `total`; returns
        sums over those tokens: loss, gap (|behaviour − recomputed|), clipped, ratio, kl."""
        b = batch_of(seqs, self.pad_id)
        ids, pos, tgt = (mx.array(a.astype("int32")) for a in (b.ids, b.pos, b.tgt))
        tmask, old, adv = mx.array(b.tmask), mx.array(b.behaviour), mx.array(b.advantage)
        ref = None
        if self.kl_coef:
            with adapter_disabled(self.backend.model, self.backend.layers) as base:
                ref = mx.stop_gradient(completion_logprobs(base, ids, pos, tgt, tmask))
                mx.eval(ref)
        (_, loss, gap, stats), g = self._value_and_grad(ids, pos, tgt, tmask, old, adv, ref,
                                                        mx.array(float(total)))
        self._grads = g if self._grads is None else tree_map(mx.add, self._grads, g)
        mx.eval(self._grads, loss, gap, stats)  # bound the graph to one micro-batch
        return dict({k: float(v) for k, v in stats.items()}, loss=float(loss), gap=float(gap))

    def grads(self) -> dict:
        """Canonical name -> the accumulated gradient (numpy), for checks."""
        import numpy as np

        from yeto.targets import peft_key

        flat = dict(tree_flatten(self._grads))
        return {peft_key(layer.hf_path or path, which): np.array(flat[f"{path}.{which}.weight"])
                for path, layer in self.backend.layers.items() for which in ("lora_A", "lora_B")}

    def step(self, lr_scale: float, max_grad_norm: float) -> None:
        """Clip the gradient's norm as torch does (0: no clipping) and take one AdamW
        step at the learning rate times `lr_scale`."""
        opt, model = self.backend.opt, self.backend.model
        grads = self._grads
        if max_grad_norm:
            grads, _ = clip_grad_norm(grads, max_grad_norm)
        opt.learning_rate = self.base_lr * lr_scale
        opt.update(model, grads)
        mx.eval(model.trainable_parameters(), opt.state)
        self._grads = None

    @contextmanager
    def engine(self):
        """A rollout engine over the trainer's own weights."""
        from yeto.rollout.mlx_engine import MLXEngine

        yield MLXEngine.wrap(self.backend.model, self.tokenizer, self.model_dir)
