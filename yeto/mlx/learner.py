"""The MLX island: `python -m yeto.mlx.learner`.

Fine-tunes a Hugging Face causal LM with peft-exact LoRA in MLX (Apple silicon, or
Linux CPU) and takes part in a DiLoCo run through `yeto.island.Island`, next to
torch islands: same flags (`yeto.learner.add_island_args`), same model pinning
(`yeto.data.provenance`), same tokenizer (`transformers.AutoTokenizer`), same data
pipeline, packing and batch order, same loss normalisation (Σ w·CE / Σ w over all
micro-batches of a step), same AdamW, same canonical names and flat order. Only
the numbers differ, by float rounding (see tests/integration/test_parity.py).

Outputs (``--output DIR``), as the torch island's:
  DIR/adapter/      peft adapter (``peft.PeftModel.from_pretrained``), provenance.json
  DIR/mlx/          the same adapter for ``mlx_lm.load(model, adapter_path=DIR/mlx)``
  DIR/summary.json, DIR/metrics.jsonl, DIR/provenance.json

Example (with a syncer on 127.0.0.1:29400, two islands):
    python -m yeto.mlx.learner --model runs/demo/model --data runs/demo/data/train.jsonl \\
        --eval-data runs/demo/data/eval.jsonl --syncer 127.0.0.1:29400 \\
        --learner-id island-1 --num-learners 2 --max-steps 200 --output runs/island-1
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import numpy as np

from yeto.config import D, IslandConfig, add_island_args, parse_island_args
from yeto.data import Blocks, attention_mask, is_naive
from yeto.interop.adapters import (
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    AdapterConversionError,
    peft_adapter_config,
    peft_to_mlx,
    save_peft_adapter,
)
from yeto.loop import Solo, run_island
from yeto.mlx import INSTALL_HINT

log = logging.getLogger("yeto.mlx.learner")


# ---- model ------------------------------------------------------------------
def build_lora_model(model_dir: Path, r: int, alpha: float, targets: str, seed: int,
                     lazy: bool = False):
    """mlx-lm model (float32, frozen) with peft-shaped LoRA attached.
    Returns (model, hf_config, {module path: LoRALinear})."""
    from yeto.mlx.hf_paths import hf_weight_names
    from yeto.mlx.load import load_model, read_config
    from yeto.mlx.lora import attach_lora

    model, _ = load_model(model_dir, lazy=lazy)
    hf_config = read_config(model_dir)
    layers = attach_lora(model, hf_config, r, alpha, targets, seed,
                         hf_weight_names=hf_weight_names(model_dir))
    return model, hf_config, layers


# ---- loss -------------------------------------------------------------------
def document_mask(positions):
    """Block-diagonal causal mask (b, 1, T, T) for document-packed blocks; None for
    plain causal blocks (mlx-lm's own causal mask, the fast path)."""
    import mlx.core as mx

    if positions is None or is_naive(positions):
        return None
    return mx.array(attention_mask(np.asarray(positions)))[:, None]


def logits_of(model, inputs, mask=None):
    from yeto.mlx.packing import document_cache

    if mask is None:
        return model(inputs)
    return model(inputs, cache=document_cache(model, mask))


def weighted_ce_sum(model, tokens, weights, positions=None, mask=None):
    """Σ w·CE over the batch (normalised by the caller over the whole step); with
    ``positions`` (or a ready ``mask``), packed documents do not attend to each
    other. The MLX twin of `yeto.learner.weighted_ce_sum`."""
    import mlx.core as mx
    import mlx.nn as nn

    if mask is None:
        mask = document_mask(positions)
    logits = logits_of(model, tokens[:, :-1], mask).astype(mx.float32)
    ce = nn.losses.cross_entropy(logits, tokens[:, 1:], reduction="none")
    return (ce * weights).sum()


def make_loss_and_grad(model):
    """f(tokens, weights, denom, positions=None) -> (Σw·CE / denom, grads of the
    trainable (LoRA) parameters); numpy or mx inputs."""
    import mlx.core as mx
    import mlx.nn as nn

    def loss_fn(tokens, weights, denom, mask):
        return weighted_ce_sum(model, tokens, weights, mask=mask) / denom

    value_and_grad = nn.value_and_grad(model, loss_fn)

    def run(tokens, weights, denom, positions=None):
        return value_and_grad(mx.array(tokens), mx.array(weights), mx.array(denom, mx.float32),
                              document_mask(positions))

    return run


def train_step(model, opt, micro_batches, loss_and_grad,
               before_update=None) -> tuple[float, int]:
    """One optimizer step over grad-accum micro-batches (`yeto.data.Batch`, or plain
    (tokens, weights) pairs); returns (loss, loss tokens). Same normalisation as the
    torch island: Σ w·CE / Σ w over the whole step. `before_update()` (the island's
    guard) runs once the gradients are computed, right before the update."""
    import mlx.core as mx
    from mlx.utils import tree_map

    total_w = float(sum(mb[1].sum() for mb in micro_batches))
    denom = max(total_w, 1.0)
    grads, losses = None, []
    for mb in micro_batches:
        loss, g = loss_and_grad(mb[0], mb[1], denom, getattr(mb, "positions", None))
        grads = g if grads is None else tree_map(lambda a, b: a + b, grads, g)
        losses.append(loss)
        if len(micro_batches) > 1:
            mx.eval(grads, loss)  # bound the graph to one micro-batch
    if before_update is not None:
        mx.eval(grads, losses)  # the gradients, computed before the guard
        before_update()
    opt.update(model, grads)
    mx.eval(model.trainable_parameters(), opt.state, losses)
    loss_sum = sum(float(x) for x in losses)
    return loss_sum, int(sum(np.count_nonzero(mb[1]) for mb in micro_batches))


def evaluate(model, blocks: Blocks, batch_size: int) -> float:
    """Token-weighted mean CE over all held-out blocks."""
    import mlx.core as mx

    total, weight = 0.0, 0.0
    for lo in range(0, len(blocks), batch_size):
        b = blocks[lo:lo + batch_size]
        total += float(weighted_ce_sum(model, mx.array(b.tokens), mx.array(b.weights),
                                       b.positions))
        weight += float(b.weights.sum())
    return total / max(weight, 1.0)


def make_optimizer(lr: float, weight_decay: float):
    """torch.optim.AdamW's exact settings: betas (0.9, 0.999), eps 1e-8, bias
    correction on, decoupled weight decay (mlx's own defaults differ: no bias
    correction, weight decay 0.01)."""
    import mlx.optimizers as optim

    return optim.AdamW(learning_rate=lr, betas=[0.9, 0.999], eps=1e-8,
                       weight_decay=weight_decay, bias_correction=True)


# ---- outputs ----------------------------------------------------------------
def export_files(base_model: str, r: int, alpha: float, targets,
                 target_parameters=None) -> tuple[str, dict[str, str]]:
    """The weights file name and adapter_config.json the syncer writes beside its
    final weights: the same content the torch island sends for the same flags
    (``target_parameters``: adapted fused expert weights)."""
    return PEFT_WEIGHTS, {PEFT_CONFIG: peft_adapter_config(base_model, r, alpha, targets,
                                                           target_parameters=target_parameters)}


def save_outputs(out: Path, tensors: dict[str, np.ndarray], config_text: str,
                 model_dir: Path) -> None:
    save_peft_adapter(out / "adapter", tensors, config_text)
    try:
        peft_to_mlx(out / "adapter", out / "mlx", base_model=model_dir)
    except AdapterConversionError as e:  # the peft adapter is the island's output
        log.warning("no mlx-lm copy of the adapter in %s: %s", out / "mlx", e)


# ---- the backend -------------------------------------------------------------
class MLXBackend:
    """The MLX edge of an island (`yeto.loop.Backend`): one process, LoRA only."""

    name = "mlx"

    def __init__(self, cfg: IslandConfig):
        import mlx.core as mx

        mx.random.seed(cfg.seed)
        self.group = Solo()
        self.model_dir: Path | None = None
        self.tokenizer = None
        self.layers: dict = {}
        self.model = self.opt = self.loss_and_grad = None
        self.before_update = None  # the island's guard, once installed

    def load(self, cfg: IslandConfig, source):
        from transformers import AutoTokenizer

        self.model_dir = Path(source.path)
        self.tokenizer = AutoTokenizer.from_pretrained(
            str(source.path), trust_remote_code=source.trust_remote_code)
        return self.tokenizer

    def attach(self, cfg: IslandConfig):
        from yeto.mlx.lora import LoRAWeights

        self.model, _, self.layers = build_lora_model(self.model_dir, cfg.lora_r,
                                                      cfg.lora_alpha, cfg.lora_targets, cfg.seed)
        self.opt = make_optimizer(cfg.inner_lr, cfg.weight_decay)
        self.loss_and_grad = make_loss_and_grad(self.model)
        self.weights = LoRAWeights(self.layers)
        return self.weights

    def export_files(self, cfg: IslandConfig) -> tuple[str, dict[str, str]]:
        from yeto.mlx.lora import adapter_targets

        modules, params = adapter_targets(self.layers)
        return export_files(str(self.model_dir), cfg.lora_r, cfg.lora_alpha, modules, params)

    def train_step(self, micro_batches) -> tuple[float, int]:
        return train_step(self.model, self.opt, micro_batches, self.loss_and_grad,
                          self.before_update)

    def guard_updates(self, before_update) -> bool:
        """Run the island's guard right before each update (`train_step`)."""
        self.before_update = before_update
        return True

    def evaluate(self, blocks, batch_size: int) -> float:
        return evaluate(self.model, blocks, batch_size)

    def save(self, cfg: IslandConfig, out: Path) -> Path:
        _, files = self.export_files(cfg)
        save_outputs(out, self.weights.tensors(), files[PEFT_CONFIG], self.model_dir)
        return out / "adapter"

    def release(self) -> None:
        """Drop the model and its optimizer (the run is over and saved)."""
        self.model = self.opt = self.loss_and_grad = None

    def describe(self) -> str:
        import mlx.core as mx

        return f"mlx {mx.default_device()}"


# ---- CLI --------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m yeto.mlx.learner",
        description="An MLX island: fine-tunes a Hugging Face causal LM with peft-shaped LoRA "
                    "in MLX and syncs with a yeto syncer every --sync-every steps; it joins "
                    "the same runs as torch islands (python -m yeto.learner). It takes the "
                    "torch island's flags but --tuning full, --lora-freeze-a, --device and "
                    "--threads.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Example:\n  python -m yeto.mlx.learner --model runs/demo/model "
               "--data runs/demo/data/train.jsonl --syncer 127.0.0.1:29400 "
               "--learner-id island-1 --num-learners 2 --output runs/island-1")
    add_island_args(p)
    p.add_argument("--tuning", choices=("lora",), default=D.tuning,
                   help="the MLX island trains LoRA adapters only")
    return p


def main(argv=None) -> int:
    p = build_parser()
    cfg = parse_island_args(p, argv)
    if cfg.lora_freeze_a:
        p.error("--lora-freeze-a is not supported by the MLX island yet; run the fleet "
                "without it (every island must use the same LoRA mode)")
    from yeto.mlx import mlx_available

    if not mlx_available():
        print(f"error: {INSTALL_HINT}", file=sys.stderr)
        return 2
    return run_island(cfg, MLXBackend(cfg))


if __name__ == "__main__":
    from yeto.signals import island_process

    sys.exit(island_process(main))
