"""The torch island: `python -m yeto.learner`.

Fine-tunes a Hugging Face causal LM (peft LoRA, or full weights) on its shard of
the data and takes part in a DiLoCo run through `yeto.island.Island`.

Example (with a syncer on 127.0.0.1:29400, two islands):
    python -m yeto.learner --model runs/demo/model --data runs/demo/data/train.jsonl \\
        --eval-data runs/demo/data/eval.jsonl --syncer 127.0.0.1:29400 \\
        --learner-id island-0 --num-learners 2 --max-steps 200 --output runs/island-0
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from yeto import codec, wire
from yeto.data import BatchSampler, Blocks, DataError, load_blocks
from yeto.island import Island
from yeto.layout import Layout
from yeto.targets import TARGET_MODES, select_targets

log = logging.getLogger("yeto.learner")


# ---- model ------------------------------------------------------------------
def load_base(model: str, dtype=torch.float32):
    """Load model + tokenizer from a local dir or a hub id (already cached)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model)
    if not path.exists() and (model.startswith((".", "/")) or model.count("/") != 1):
        raise FileNotFoundError(
            f"model {model!r} not found: pass a local Hugging Face model dir or a hub id. "
            "Example: yeto make-tiny-model runs/tiny && python -m yeto.learner --model "
            "runs/tiny ...")
    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, use_safetensors=True)
    return lm, tok


def linear_paths(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def attach_lora(model, r: int, alpha: float, targets: str, seed: int):
    from peft import LoraConfig, get_peft_model

    chosen = select_targets(linear_paths(model), targets, model.config.to_dict())
    torch.manual_seed(seed)  # same init on every island with the same seed
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=chosen, lora_dropout=0.0,
                     bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


class TorchWeights:
    """The trainable tensors of a torch model under canonical names, as one flat
    float32 vector (the island's view of the model)."""

    def __init__(self, model: torch.nn.Module, tuning: str):
        self.params: dict[str, torch.nn.Parameter] = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                self.params[canonical_name(name, tuning)] = p
        self.layout = Layout.from_shapes({k: tuple(p.shape) for k, p in self.params.items()})
        self._ordered = [self.params[s.name] for s in self.layout.specs]

    def get(self) -> np.ndarray:
        with torch.no_grad():
            return torch.cat([p.detach().reshape(-1).float() for p in self._ordered]).numpy().copy()

    def set(self, flat: np.ndarray) -> None:
        src = torch.from_numpy(np.ascontiguousarray(flat, dtype=np.float32))
        with torch.no_grad():
            pos = 0
            for p in self._ordered:
                n = p.numel()
                p.copy_(src[pos:pos + n].view_as(p))
                pos += n


def canonical_name(param_name: str, tuning: str) -> str:
    """peft's saved key for LoRA (adapter name dropped); the HF name in full mode."""
    if tuning == "lora":
        return param_name.replace(".default.", ".")
    return param_name


# ---- loss -------------------------------------------------------------------
def weighted_ce_sum(model, tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ w·CE over the batch (normalised by the caller over the whole step)."""
    logits = model(input_ids=tokens[:, :-1]).logits
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                           tokens[:, 1:].reshape(-1).long(), reduction="none")
    return (ce * weights.reshape(-1)).sum()


@torch.no_grad()
def evaluate(model, blocks: Blocks, batch_size: int, device) -> float:
    """Token-weighted mean CE over all held-out blocks."""
    was_training = model.training
    model.eval()
    total, weight = 0.0, 0.0
    for lo in range(0, len(blocks), batch_size):
        t = torch.from_numpy(blocks.tokens[lo:lo + batch_size]).to(device)
        w = torch.from_numpy(blocks.weights[lo:lo + batch_size]).to(device)
        total += float(weighted_ce_sum(model, t, w))
        weight += float(w.sum())
    model.train(was_training)
    return total / max(weight, 1.0)


def train_step(model, opt, micro_batches, device) -> tuple[float, int]:
    """One optimizer step over grad-accum micro-batches; returns (loss, loss tokens)."""
    total_w = float(sum(w.sum() for _, w in micro_batches))
    opt.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for tokens, weights in micro_batches:
        t = torch.from_numpy(tokens).to(device)
        w = torch.from_numpy(weights).to(device)
        loss = weighted_ce_sum(model, t, w) / max(total_w, 1.0)
        loss.backward()
        loss_sum += float(loss.detach())
    opt.step()
    return loss_sum, int(sum(np.count_nonzero(w) for _, w in micro_batches))


# ---- outputs ----------------------------------------------------------------
def save_output(model, out: Path, tuning: str, tokenizer=None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if tuning == "full" and tokenizer is not None:
        tokenizer.save_pretrained(out)


def export_files(model, tuning: str) -> tuple[str, dict[str, str]]:
    """The weights file name and text files the syncer writes beside its final
    weights, so its output loads exactly like an island's."""
    if tuning == "full":
        return "model.safetensors", {"config.json": model.config.to_json_string()}
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        return "adapter_model.safetensors", {
            "adapter_config.json": (Path(d) / "adapter_config.json").read_text()}


# ---- CLI --------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m yeto.learner",
        description="A torch island: fine-tunes a Hugging Face causal LM on its shard of the "
                    "data and syncs with a yeto syncer every --sync-every steps.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Example:\n  python -m yeto.learner --model runs/demo/model "
               "--data runs/demo/data/train.jsonl --syncer 127.0.0.1:29400 "
               "--learner-id island-0 --num-learners 2 --output runs/island-0")
    add_island_args(p)
    p.add_argument("--tuning", choices=("lora", "full"), default="lora",
                   help="train LoRA adapters, or all weights")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    return p


def add_island_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by the torch and MLX islands."""
    p.add_argument("--model", help="local Hugging Face model dir or hub id (required)")
    p.add_argument("--data", help="training JSONL (text | messages | prompt/completion rows)")
    p.add_argument("--eval-data", default=None, help="held-out JSONL, evaluated at every sync")
    p.add_argument("--syncer", default="none",
                   help="syncer host:port, or 'none' to train as a single island")
    p.add_argument("--learner-id", default="island-0", help="this island's name in the run")
    p.add_argument("--learner-index", type=int, default=None,
                   help="which data shard (row i goes to island i mod --num-learners); "
                        "default: the number at the end of --learner-id")
    p.add_argument("--num-learners", type=int, default=1, help="islands sharing the data")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank")
    p.add_argument("--lora-alpha", type=float, default=32, help="LoRA alpha (scale alpha/r)")
    p.add_argument("--lora-targets", default="auto",
                   help=f"{' | '.join(TARGET_MODES)} | comma list of module names")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training block")
    p.add_argument("--batch-size", type=int, default=8, help="blocks per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--inner-lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--sync-every", type=int, default=50, metavar="H",
                   help="push to the syncer every H optimizer steps")
    p.add_argument("--wire", choices=codec.ENCODINGS, default="q4",
                   help="encoding of pushes (q4 keeps the residual: error feedback)")
    p.add_argument("--blocking-sync", action="store_true",
                   help="wait for the merged weights after every push (islands then hold "
                        "identical weights after each round) instead of training on")
    p.add_argument("--max-steps", type=int, default=200, help="optimizer steps to train")
    p.add_argument("--eval-blocks", type=int, default=64,
                   help="held-out blocks evaluated per sync (0 = all)")
    p.add_argument("--output", type=Path, default=None, help="where the final adapter is saved")
    p.add_argument("--seed", type=int, default=0, help="seed for init and batch order")
    p.add_argument("--token", default=None, help=f"syncer token (default: ${wire.TOKEN_ENV})")
    p.add_argument("--tls-ca", type=Path, default=None, help="CA of the syncer's certificate")
    p.add_argument("--tls-cert", type=Path, default=None, help="client certificate (mutual TLS)")
    p.add_argument("--tls-key", type=Path, default=None, help="client key (mutual TLS)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--log-level", default="INFO")


def check_island_args(p: argparse.ArgumentParser, args) -> None:
    """Errors that need no model loaded, with an example where it helps."""
    example = ("example: python -m yeto.learner --model runs/demo/model "
               "--data runs/demo/data/train.jsonl --syncer 127.0.0.1:29400")
    if not args.model:
        p.error(f"--model is required ({example}); `yeto make-tiny-model DIR` builds a "
                "tiny local one")
    if not args.data:
        p.error(f"--data is required ({example}); `yeto make-task DIR` writes a small task")
    for flag in ("num_learners", "lora_r", "seq_len", "batch_size", "grad_accum", "sync_every",
                 "max_steps"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.learner_index is None:
        tail = args.learner_id[len(args.learner_id.rstrip("0123456789")):]
        args.learner_index = int(tail) if tail else 0
    if not 0 <= args.learner_index < args.num_learners:
        p.error(f"learner index {args.learner_index} is outside 0..{args.num_learners - 1}; "
                "set --learner-index or --num-learners")


def make_client(args, layout, backend: str, weights_file: str, files: dict[str, str]):
    from yeto.client import SyncerClient, TLSConfig

    if args.syncer in ("none", "", None):
        return None
    tls = None
    if args.tls_ca or args.tls_cert:
        tls = TLSConfig(ca=args.tls_ca.read_bytes() if args.tls_ca else None,
                        cert=args.tls_cert.read_bytes() if args.tls_cert else None,
                        key=args.tls_key.read_bytes() if args.tls_key else None)
    return SyncerClient(args.syncer, args.learner_id, layout, token=args.token, backend=backend,
                        weights_file=weights_file, export_files=files, tls=tls)


def progress_bar(args, desc: str):
    from tqdm import tqdm

    return tqdm(total=args.max_steps, desc=desc, disable=args.no_progress, dynamic_ncols=True,
                mininterval=1.0, file=sys.stderr)


def write_metrics(out: Path | None, record: dict) -> None:
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    check_island_args(p, args)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s {args.learner_id} %(message)s", datefmt="%H:%M:%S")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                          if args.device == "auto" else args.device)
    torch.manual_seed(args.seed)
    try:
        model, tok = load_base(args.model)
        shard = (args.learner_index, args.num_learners)
        train = load_blocks(args.data, tok, args.seq_len, shard=shard)
        held_out = load_blocks(args.eval_data, tok, args.seq_len) if args.eval_data else None
    except (FileNotFoundError, OSError, DataError) as e:
        log.error("%s", e)
        return 2
    if held_out is not None and args.eval_blocks:
        held_out = Blocks(held_out.tokens[:args.eval_blocks], held_out.weights[:args.eval_blocks])
    if args.tuning == "lora":
        model = attach_lora(model, args.lora_r, args.lora_alpha, args.lora_targets, args.seed)
    model.to(device).train()
    weights = TorchWeights(model, args.tuning)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                            lr=args.inner_lr, weight_decay=args.weight_decay)
    weights_file, files = export_files(model, args.tuning)
    client = make_client(args, weights.layout, "torch", weights_file, files)

    def eval_loss() -> float:
        return evaluate(model, held_out, args.batch_size, device) if held_out else float("nan")

    island = Island(weights.layout, weights.get, weights.set, client=client,
                    sync_every=args.sync_every, wire=args.wire, blocking=args.blocking_sync,
                    on_sync=eval_loss)
    log.info("%d trainable tensors, %d parameters (%s); %d training blocks, %d loss tokens",
             len(weights.layout.specs), weights.layout.numel, args.tuning, len(train),
             train.loss_tokens)
    island.start()
    before = eval_loss()
    write_metrics(args.output, dict(step=0, eval_loss=before, version=island.version))
    log.info("held-out loss before training: %.4f", before)
    run_training(args, model, opt, train, island, device, "torch")
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
        save_output(model, args.output / "adapter" if args.tuning == "lora"
                    else args.output / "model", args.tuning, tok)
        write_metrics(args.output, summary)
        (args.output / "summary.json").write_text(json.dumps(summary, indent=2))
        log.info("saved to %s", args.output)
    return 0


def run_training(args, model, opt, train, island: Island, device, backend: str) -> None:
    sampler = BatchSampler(train, args.batch_size, seed=args.seed + args.learner_index)
    bar = progress_bar(args, f"{args.learner_id} ({backend})")
    t0, tokens_seen = time.perf_counter(), 0
    for _ in range(args.max_steps):
        micro = [next(sampler) for _ in range(args.grad_accum)]
        loss, loss_tokens = train_step(model, opt, micro, device)
        tokens_seen += sum(t.shape[0] * (t.shape[1] - 1) for t, _ in micro)
        done = island.after_step(loss_tokens, train_loss=loss)
        if island.step % args.sync_every == 0:
            write_metrics(args.output, dict(step=island.step, train_loss=loss,
                                            eval_loss=island.eval_loss, version=island.version))
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_seen / (time.perf_counter() - t0):.0f}",
                        round=island.version, refresh=False)
        if done or not math.isfinite(loss):
            if not math.isfinite(loss):
                log.error("training loss is %s at step %d: lower --inner-lr", loss, island.step)
            break
    bar.close()


if __name__ == "__main__":
    sys.exit(main())
