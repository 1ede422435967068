"""The MLX island: `python -m yeto.mlx.learner`.

Fine-tunes a Hugging Face causal LM with peft-exact LoRA in MLX (Apple silicon, or
Linux CPU) and takes part in a DiLoCo run through `yeto.island.Island`, next to
torch islands: same flags (`yeto.learner.add_island_args`), same model pinning
(`yeto.data.provenance`), same tokenizer (`transformers.AutoTokenizer`), same data
pipeline, packing and batch order, same loss normalisation (Σ w·CE / Σ w over all
micro-batches of a step), same AdamW, same canonical names and flat order. Only
the numbers differ, by float rounding (see tests/test_parity.py).

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
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

from yeto.data import Blocks, DataError, attention_mask, is_naive, load_blocks
from yeto.data.provenance import ProvenanceError, build_record, resolve_model, write_provenance
from yeto.interop.adapters import (
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    peft_adapter_config,
    peft_to_mlx,
    save_peft_adapter,
)
from yeto.mlx import INSTALL_HINT
from yeto.torch.learner import (
    add_island_args,
    check_island_args,
    make_client,
    make_island,
    run_training,
    stop_on_signals,
    write_metrics,
)

log = logging.getLogger("yeto.mlx.learner")


# ---- model ------------------------------------------------------------------
def hf_weight_names(model_dir: Path) -> set[str]:
    """Tensor names of the Hugging Face checkpoint (headers only)."""
    from safetensors import safe_open

    names: set[str] = set()
    for f in sorted(Path(model_dir).glob("model*.safetensors")):
        with safe_open(str(f), framework="numpy") as st:
            names.update(st.keys())
    return names


def build_lora_model(model_dir: Path, r: int, alpha: float, targets: str, seed: int,
                     lazy: bool = False):
    """mlx-lm model (float32, frozen) with peft-shaped LoRA attached.
    Returns (model, hf_config, {module path: LoRALinear})."""
    from yeto.mlx.lora import attach_lora
    from yeto.mlx.shims import load_model, read_config

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
    from yeto.mlx.shims import document_cache

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


def train_step(model, opt, micro_batches, loss_and_grad) -> tuple[float, int]:
    """One optimizer step over grad-accum micro-batches (`yeto.data.Batch`, or plain
    (tokens, weights) pairs); returns (loss, loss tokens). Same normalisation as the
    torch island: Σ w·CE / Σ w over the whole step."""
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
def export_files(base_model: str, r: int, alpha: float, targets) -> tuple[str, dict[str, str]]:
    """The weights file name and adapter_config.json the syncer writes beside its
    final weights: the same content the torch island sends for the same flags."""
    return PEFT_WEIGHTS, {PEFT_CONFIG: peft_adapter_config(base_model, r, alpha, targets)}


def save_outputs(out: Path, tensors: dict[str, np.ndarray], config_text: str,
                 model_dir: Path) -> None:
    save_peft_adapter(out / "adapter", tensors, config_text)
    peft_to_mlx(out / "adapter", out / "mlx", base_model=model_dir)


# ---- CLI --------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m yeto.mlx.learner",
        description="An MLX island: fine-tunes a Hugging Face causal LM with peft-shaped LoRA "
                    "in MLX and syncs with a yeto syncer every --sync-every steps; it joins "
                    "the same runs as torch islands (python -m yeto.learner).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Example:\n  python -m yeto.mlx.learner --model runs/demo/model "
               "--data runs/demo/data/train.jsonl --syncer 127.0.0.1:29400 "
               "--learner-id island-1 --num-learners 2 --output runs/island-1")
    add_island_args(p)
    p.add_argument("--tuning", choices=("lora",), default="lora",
                   help="the MLX island trains LoRA adapters only")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    check_island_args(p, args)
    if args.lora_freeze_a:
        p.error("--lora-freeze-a is not supported by the MLX island yet; run the fleet "
                "without it (every island must use the same LoRA mode)")
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s {args.learner_id} %(message)s", datefmt="%H:%M:%S")
    from yeto.mlx import mlx_available

    if not mlx_available():
        log.error("%s", INSTALL_HINT)
        return 2
    import mlx.core as mx
    from transformers import AutoTokenizer

    from yeto.mlx.lora import LoRAWeights

    mx.random.seed(args.seed)
    try:
        source = resolve_model(args.model, args.model_revision, args.trust_remote_code)
        tok = AutoTokenizer.from_pretrained(str(source.path),
                                            trust_remote_code=source.trust_remote_code)
        shard = (args.learner_index, args.num_learners)
        train = load_blocks(args.data, tok, args.seq_len, shard=shard, packing=args.packing,
                            revision=args.data_revision, split=args.data_split)
        held_out = load_blocks(args.eval_data, tok, args.seq_len, packing=args.packing,
                               revision=args.eval_data_revision, split=args.eval_split,
                               held_out=True) if args.eval_data else None
        model, _, layers = build_lora_model(source.path, args.lora_r, args.lora_alpha,
                                            args.lora_targets, args.seed)
    except (FileNotFoundError, OSError, DataError, ProvenanceError, ValueError) as e:
        # ValueError: an unsupported model or --lora-targets, with the fix in the message
        log.error("%s", e)
        return 2
    provenance = build_record(source, train.info["source"], args, backend="mlx",
                              eval_data=held_out.info["source"] if held_out else None)
    if args.output:
        write_provenance(args.output, provenance)  # pinned before training starts
    if held_out is not None and args.eval_blocks:
        held_out = held_out[:args.eval_blocks]
    weights = LoRAWeights(layers)
    opt = make_optimizer(args.inner_lr, args.weight_decay)
    loss_and_grad = make_loss_and_grad(model)
    weights_file, files = export_files(str(source.path), args.lora_r, args.lora_alpha,
                                       sorted(layers))
    client = make_client(args, weights.layout, "mlx", weights_file, files)

    def eval_loss() -> float:
        return evaluate(model, held_out, args.batch_size) if held_out else float("nan")

    island = make_island(args, weights.layout, weights.get, weights.set, client, eval_loss)
    log.info("%d trainable tensors, %d parameters (lora, mlx %s); %d training blocks, "
             "%d loss tokens", len(weights.layout.specs), weights.layout.numel,
             mx.default_device(), len(train), train.loss_tokens)
    stop = stop_on_signals()
    island.start()
    before = eval_loss()
    write_metrics(args.output, dict(step=0, eval_loss=before, version=island.version,
                                    time=time.time()))
    log.info("held-out loss before training: %.4f", before)
    run_training(args, lambda micro: train_step(model, opt, micro, loss_and_grad), train, island,
                 "mlx", stop=stop)
    island.finish()
    after = eval_loss()
    log.info("held-out loss after training: %.4f (before %.4f)", after, before)
    summary = dict(step=island.step, eval_loss=after, eval_loss_before=before,
                   version=island.version, final=island.finished,
                   loss_tokens=island.total_tokens, pushes=island.pushes,
                   bytes_up=client.bytes_up if client else 0,
                   bytes_down=client.bytes_down if client else 0,
                   wait_s=client.wait_s if client else 0.0)
    if args.output:
        save_outputs(args.output, weights.tensors(), files[PEFT_CONFIG], source.path)
        write_provenance(args.output / "adapter", provenance)
        write_metrics(args.output, summary)
        (args.output / "summary.json").write_text(json.dumps(summary, indent=2))
        log.info("saved to %s", args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
