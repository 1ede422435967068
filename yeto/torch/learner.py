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
import hashlib
import json
import logging
import math
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from yeto import codec, frozen, net
from yeto.data import PACKING, BatchSampler, Blocks, DataError, load_blocks
from yeto.data.provenance import (
    ModelSource,
    ProvenanceError,
    build_record,
    resolve_model,
    write_provenance,
)
from yeto.island import Island
from yeto.layout import Layout
from yeto.targets import TARGET_MODES, select_targets
from yeto.torch import group as dist_group

log = logging.getLogger("yeto.learner")


# ---- model ------------------------------------------------------------------
def load_base(model: str | ModelSource, dtype=torch.float32, *, revision: str | None = None,
              trust_remote_code: bool = False):
    """Load model + tokenizer from a local dir or a hub id, pinned and checked first
    (`yeto.data.provenance.resolve_model`: safetensors only, no repo code unless trusted)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = model if isinstance(model, ModelSource) else resolve_model(
        model, revision=revision, trust_remote_code=trust_remote_code)
    trust = src.trust_remote_code
    tok = AutoTokenizer.from_pretrained(str(src.path), trust_remote_code=trust)
    lm = AutoModelForCausalLM.from_pretrained(str(src.path), dtype=dtype, use_safetensors=True,
                                              trust_remote_code=trust)
    return lm, tok


def linear_paths(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def attach_lora(model, r: int, alpha: float, targets: str, seed: int,
                freeze_a: bool = False):
    """peft LoRA on the shared target selection. With `freeze_a`, every lora_A is
    drawn from `seed` by `yeto.frozen` (the same bits on every island and backend)
    and never trained, so only lora_B is synced and the merge is exact."""
    from peft import LoraConfig, get_peft_model

    chosen = select_targets(linear_paths(model), targets, model.config.to_dict())
    torch.manual_seed(seed)  # same init on every island with the same seed
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=chosen, lora_dropout=0.0,
                     bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(model, cfg)
    if freeze_a:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_A." in name:
                    key = canonical_name(name, "lora")
                    p.copy_(torch.from_numpy(frozen.frozen_lora_a(key, tuple(p.shape), seed)))
                    p.requires_grad_(False)
    return model


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
def packed_inputs(model, tokens: torch.Tensor, positions: torch.Tensor | None) -> dict:
    """Forward kwargs for blocks whose documents must not attend to each other.

    ``positions`` (b, seq_len) restart at 0 at every document start (see yeto.data).
    Plain blocks (one causal sequence each, as with ``--packing naive``) get plain
    inputs. Otherwise the model gets per-document ``position_ids`` and, for eager and
    sdpa attention, an explicit 4D block-diagonal causal mask (bool for sdpa, additive
    float for eager), which transformers passes through as-is. Other attention
    implementations (flash_attention_*, flex_attention), and models whose sliding
    window is shorter than the block, get ``position_ids`` alone, from which
    transformers 5 splits packed sequences itself. The KV cache is off either way:
    with a cache transformers ignores position-id packing.
    """
    kw: dict = {"input_ids": tokens[:, :-1]}
    if positions is None:
        return kw
    pos = positions.long()
    if bool((pos == torch.arange(pos.shape[1], device=pos.device)).all()):
        return kw
    kw.update(position_ids=pos, use_cache=False)
    config = getattr(model, "module", model).config  # DDP wraps the model in torchrun islands
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl in ("eager", "sdpa") and not _sliding_window_applies(config, pos.shape[1]):
        seg = torch.cumsum(pos == 0, dim=1)
        n = pos.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=pos.device).tril()
        allowed = ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]
        if impl == "sdpa":
            kw["attention_mask"] = allowed
        else:
            dtype = next(model.parameters()).dtype
            mask = torch.zeros(allowed.shape, dtype=dtype, device=pos.device)
            kw["attention_mask"] = mask.masked_fill(~allowed, torch.finfo(dtype).min)
    return kw


def _sliding_window_applies(config, seq_len: int) -> bool:
    # A 4D mask is used as-is by every layer, so it would drop a sliding window (and
    # per-layer mixes of sliding and full attention); such models get position ids.
    window = getattr(config, "sliding_window", None)
    return bool(window) and seq_len > window and getattr(config, "use_sliding_window", True)


def weighted_ce_from_logits(logits: torch.Tensor, targets: torch.Tensor,
                            weights: torch.Tensor) -> torch.Tensor:
    """Σ w·CE, in float32 (the loss both islands compute; see yeto.data)."""
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                           targets.reshape(-1).long(), reduction="none")
    return (ce * weights.reshape(-1)).sum()


def weighted_ce_sum(model, tokens: torch.Tensor, weights: torch.Tensor,
                    positions: torch.Tensor | None = None) -> torch.Tensor:
    """Σ w·CE over the batch (normalised by the caller over the whole step); with
    ``positions``, packed documents do not attend to each other."""
    logits = model(**packed_inputs(model, tokens, positions)).logits
    return weighted_ce_from_logits(logits, tokens[:, 1:], weights)


def _positions(batch, device) -> torch.Tensor | None:
    pos = getattr(batch, "positions", None)  # a yeto.data.Batch; plain pairs have none
    return None if pos is None else torch.from_numpy(np.ascontiguousarray(pos)).to(device)


@torch.no_grad()
def evaluate(model, blocks: Blocks, batch_size: int, device) -> float:
    """Token-weighted mean CE over all held-out blocks."""
    was_training = model.training
    model.eval()
    total, weight = 0.0, 0.0
    for lo in range(0, len(blocks), batch_size):
        b = blocks[lo:lo + batch_size]
        t = torch.from_numpy(b.tokens).to(device)
        w = torch.from_numpy(b.weights).to(device)
        p = torch.from_numpy(np.ascontiguousarray(b.positions)).to(device)
        total += float(weighted_ce_sum(model, t, w, p))
        weight += float(w.sum())
    model.train(was_training)
    return total / max(weight, 1.0)


def train_step(model, opt, micro_batches, device) -> tuple[float, int]:
    """One optimizer step over grad-accum micro-batches (`yeto.data.Batch`, or plain
    (tokens, weights) pairs); returns (loss, loss tokens)."""
    total_w = float(sum(mb[1].sum() for mb in micro_batches))
    opt.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for mb in micro_batches:
        t = torch.from_numpy(mb[0]).to(device)
        w = torch.from_numpy(mb[1]).to(device)
        loss = weighted_ce_sum(model, t, w, _positions(mb, device)) / max(total_w, 1.0)
        loss.backward()
        loss_sum += float(loss.detach())
    opt.step()
    return loss_sum, int(sum(np.count_nonzero(mb[1]) for mb in micro_batches))


# ---- outputs ----------------------------------------------------------------
def save_output(model, out: Path, tuning: str, tokenizer=None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if tuning == "full" and tokenizer is not None:
        tokenizer.save_pretrained(out)


def export_files(model, tuning: str, frozen_seed: int | None = None) -> tuple[str, dict]:
    """The weights file name and text files the syncer writes beside its final
    weights, so its output loads exactly like an island's."""
    if tuning == "full":
        return "model.safetensors", {"config.json": model.config.to_json_string()}
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        config = json.loads((Path(d) / "adapter_config.json").read_text())
    # sorted: the text must not depend on set order or on which island joined first
    config["target_modules"] = sorted(config["target_modules"])
    files = {"adapter_config.json": json.dumps(config, indent=2, sort_keys=True)}
    if frozen_seed is not None:
        shapes = {canonical_name(n, "lora"): tuple(p.shape) for n, p in model.named_parameters()
                  if ".lora_A." in n}
        files[frozen.EXPORT_FILE] = frozen.describe(frozen_seed, shapes)
    return "adapter_model.safetensors", files


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
    p.add_argument("--model-revision", default=None,
                   help="branch, tag or commit of a hub --model (default main), pinned to its "
                        "commit before training; local dirs are pinned by a content digest")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow code shipped in the model repo (auto_map) to run; off by default")
    p.add_argument("--data", help="training data: a .jsonl/.json/.parquet file, a folder of them, "
                                  "a datasets save_to_disk folder or a hub dataset id; rows are "
                                  "text | messages | conversations (ShareGPT) | Alpaca | "
                                  "prompt/completion (see `yeto data --help`)")
    p.add_argument("--data-revision", default=None,
                   help="branch, tag or commit of a hub --data (default main), pinned to a commit")
    p.add_argument("--data-split", default=None,
                   help="split of a folder / hub / saved dataset --data (default train)")
    p.add_argument("--eval-data", default=None,
                   help="held-out data (same kinds as --data), evaluated at every sync")
    p.add_argument("--eval-data-revision", default=None, help="as --data-revision, for --eval-data")
    p.add_argument("--eval-split", default=None,
                   help="split of --eval-data (default validation, else test)")
    p.add_argument("--packing", choices=PACKING, default="document",
                   help="document: packed rows never attend to each other (block-diagonal "
                        "mask, positions restart per row); naive: plain causal blocks")
    p.add_argument("--syncer", default="none",
                   help="syncer host:port, or 'none' to train as a single island")
    p.add_argument("--learner-id", default="island-0", help="this island's name in the run")
    p.add_argument("--learner-index", type=int, default=None,
                   help="which data shard (row i goes to island i mod --num-learners); "
                        "default: the number at the end of --learner-id")
    p.add_argument("--num-learners", type=int, default=1, help="islands sharing the data")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank")
    p.add_argument("--lora-alpha", type=float, default=32, help="LoRA alpha (scale alpha/r)")
    p.add_argument("--lora-freeze-a", action="store_true",
                   help="draw lora_A from --seed on every island and never train or send it: "
                        "exact averaging of B, half the bytes")
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
    p.add_argument("--sync-every-seconds", type=float, default=0.0, metavar="T",
                   help="push every T seconds of wall time instead of every H steps (fleets "
                        "of mixed speed; token weighting lets faster islands count more)")
    p.add_argument("--merge-alpha", type=float, default=0.0,
                   help="keep this share of the local weights when merged weights arrive "
                        "(Streaming DiLoCo's alpha; 0 = adopt the merge plus the steps "
                        "made since the push)")
    p.add_argument("--pipeline", type=int, default=1,
                   help="fragments in flight at once when the syncer runs --fragments P")
    p.add_argument("--slowdown", type=float, default=1.0,
                   help="simulate a slower machine: each step takes this many times as "
                        "long (benchmarks of mixed-speed fleets)")
    p.add_argument("--blocking-sync", action="store_true",
                   help="wait for the merged weights after every push (islands then hold "
                        "identical weights after each round) instead of training on")
    p.add_argument("--max-steps", type=int, default=200, help="optimizer steps to train")
    p.add_argument("--eval-blocks", type=int, default=64,
                   help="held-out blocks evaluated per sync (0 = all)")
    p.add_argument("--output", type=Path, default=None, help="where the final adapter is saved")
    p.add_argument("--seed", type=int, default=0, help="seed for init and batch order")
    p.add_argument("--token", default=None, help=f"syncer token (default: ${net.TOKEN_ENV})")
    p.add_argument("--tls-ca", type=Path, default=None, help="CA of the syncer's certificate")
    p.add_argument("--tls-cert", type=Path, default=None, help="client certificate (mutual TLS)")
    p.add_argument("--tls-key", type=Path, default=None, help="client key (mutual TLS)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--log-level", default="INFO")


def check_island_args(p: argparse.ArgumentParser, args) -> None:
    """Errors that need no model loaded, with an example where it helps."""
    example = (f"example: {p.prog} --model runs/demo/model "
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


def progress_bar(args, desc: str, disable: bool = False):
    from tqdm import tqdm

    return tqdm(total=args.max_steps, desc=desc, disable=args.no_progress or disable,
                dynamic_ncols=True,
                mininterval=1.0, file=sys.stderr)


def write_metrics(out: Path | None, record: dict, group=dist_group.Group()) -> None:
    if out is None or not group.leader:
        return
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    check_island_args(p, args)
    device = dist_group.local_device(args.device)
    group = dist_group.init_group(device)  # torchrun: N processes, one island
    who = args.learner_id + (f"/{group.rank}" if group.active else "")
    logging.basicConfig(level=args.log_level.upper() if group.leader else "WARNING",
                        format=f"%(asctime)s {who} %(message)s", datefmt="%H:%M:%S")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    try:
        source = resolve_model(args.model, args.model_revision, args.trust_remote_code)
        model, tok = load_base(source)
        shard = (args.learner_index, args.num_learners)
        train = load_blocks(args.data, tok, args.seq_len, shard=shard, packing=args.packing,
                            revision=args.data_revision, split=args.data_split)
        held_out = load_blocks(args.eval_data, tok, args.seq_len, packing=args.packing,
                               revision=args.eval_data_revision, split=args.eval_split,
                               held_out=True) if args.eval_data else None
    except (FileNotFoundError, OSError, DataError, ProvenanceError) as e:
        log.error("%s", e)
        return 2
    if group.active:  # each rank trains on its own slice of the island's shard
        train = train[group.rank::group.world]
    provenance = build_record(source, train.info["source"], args, backend="torch",
                              eval_data=held_out.info["source"] if held_out else None)
    if args.output and group.leader:
        write_provenance(args.output, provenance)  # pinned before training starts
    if held_out is not None and args.eval_blocks:
        held_out = held_out[:args.eval_blocks]
    if args.tuning == "lora":
        model = attach_lora(model, args.lora_r, args.lora_alpha, args.lora_targets, args.seed,
                            freeze_a=args.lora_freeze_a)
    model.to(device).train()
    weights = TorchWeights(model, args.tuning)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                            lr=args.inner_lr, weight_decay=args.weight_decay)
    stepper = model
    if group.active:  # identical steps on every rank: gradients are averaged by DDP
        stepper = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    weights_file, files = export_files(model, args.tuning,
                                       args.seed if args.lora_freeze_a else None)
    client = make_client(args, weights.layout, "torch", weights_file, files) \
        if group.leader else None

    def eval_loss() -> float:
        return evaluate(model, held_out, args.batch_size, device) if held_out else float("nan")

    island = make_island(args, weights.layout, weights.get, weights.set, client, eval_loss)
    log.info("%d trainable tensors, %d parameters (%s); %d training blocks, %d loss tokens%s",
             len(weights.layout.specs), weights.layout.numel, args.tuning, len(train),
             train.loss_tokens, f"; {group.world} ranks" if group.active else "")
    stop = stop_on_signals()
    island.start()
    dist_group.share_weights(group, True, weights.get, weights.set, weights.layout.numel)
    before = eval_loss() if group.leader else float("nan")
    write_metrics(args.output, dict(step=0, eval_loss=before, version=island.version,
                                    time=time.time()), group)
    log.info("held-out loss before training: %.4f", before)
    tokens_per_s = run_training(args, lambda micro: train_step(stepper, opt, micro, device),
                                train, island, "torch", stop=stop, group=group, weights=weights)
    if group.leader:
        island.finish()
    dist_group.share_weights(group, True, weights.get, weights.set, weights.layout.numel)
    after = eval_loss() if group.leader else float("nan")
    log.info("held-out loss after training: %.4f (before %.4f)", after, before)
    summary = dict(step=island.step, eval_loss=after, eval_loss_before=before,
                   version=island.version, final=island.finished,
                   loss_tokens=island.total_tokens, pushes=island.pushes,
                   bytes_up=client.bytes_up if client else 0,
                   bytes_down=client.bytes_down if client else 0,
                   wait_s=client.wait_s if client else 0.0, ranks=group.world,
                   tokens_per_s=tokens_per_s)
    if args.output and group.leader:
        saved = args.output / "adapter" if args.tuning == "lora" else args.output / "model"
        save_output(model, saved, args.tuning, tok)
        write_provenance(saved, provenance)
        write_metrics(args.output, summary)
        (args.output / "summary.json").write_text(json.dumps(summary, indent=2))
        log.info("saved to %s", args.output)
    dist_group.close(group)
    return 0


def make_island(args, layout, get_weights, set_weights, client, on_sync) -> Island:
    """The island core with the flags both backends share."""
    return Island(layout, get_weights, set_weights, client=client,
                  sync_every=args.sync_every, sync_every_seconds=args.sync_every_seconds,
                  merge_alpha=args.merge_alpha, pipeline=args.pipeline, wire=args.wire,
                  blocking=args.blocking_sync, on_sync=on_sync)


def stop_on_signals() -> threading.Event:
    """First SIGINT/SIGTERM: finish the step, sync, save. Second: stop at once."""
    stop = threading.Event()

    def handler(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        log.warning("%s: stopping after this step; finishing and saving (again to stop at once)",
                    signal.Signals(signum).name)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)
    return stop


def run_training(args, step_fn, train, island: Island, backend: str, *,
                 stop: threading.Event | None = None, group=dist_group.Group(),
                 weights=None) -> float:
    """The inner loop both backends share: `step_fn(micro_batches) -> (loss, loss
    tokens)` is one optimizer step. In a torchrun group only rank 0's island talks
    to the syncer; merged weights reach the other ranks at the same step boundary.
    Returns the island's training tokens per second (all ranks together)."""
    sampler = BatchSampler(train, args.batch_size, seed=args.seed + args.learner_index)
    bar = progress_bar(args, f"{args.learner_id} ({backend})", disable=not group.leader)
    t0, tokens_seen = time.perf_counter(), 0
    for step in range(1, args.max_steps + 1):
        t_step = time.perf_counter()
        micro = [next(sampler) for _ in range(args.grad_accum)]
        loss, loss_tokens = step_fn(micro)
        tokens_seen += sum(mb[0].shape[0] * (mb[0].shape[1] - 1) for mb in micro)
        if args.slowdown > 1:  # a slower machine, simulated: stretch the step
            time.sleep((args.slowdown - 1) * (time.perf_counter() - t_step))
        loss_tokens = dist_group.sum_over_ranks(group, loss_tokens)
        pushes, versions = island.pushes, dict(island.versions)
        done = island.after_step(loss_tokens, train_loss=loss) if group.leader else False
        if group.active:
            done, applied = dist_group.share_weights(group, island.versions != versions,
                                                     weights.get, weights.set,
                                                     weights.layout.numel, done)
            if applied:
                _record_rank_weights(args, group, step, weights)
        if island.pushes != pushes or (island.client is None
                                       and island.step % args.sync_every == 0):
            write_metrics(args.output, dict(
                step=island.step, train_loss=loss, eval_loss=island.eval_loss,
                version=island.version, loss_tokens=island.total_tokens,
                tokens_per_s=island.total_tokens / (time.perf_counter() - t0),
                time=time.time()), group)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_seen / (time.perf_counter() - t0):.0f}",
                        round=island.version, refresh=False)
        if not math.isfinite(loss):
            log.error("training loss is %s at step %d: lower --inner-lr", loss, island.step)
            break
        if done or (stop is not None and stop.is_set()):
            break
    bar.close()
    return dist_group.sum_over_ranks(group, tokens_seen) / (time.perf_counter() - t0)


def _record_rank_weights(args, group, step: int, weights) -> None:
    """torchrun islands: each rank notes a digest of its weights after a merge."""
    if args.output and group.active:
        digest = hashlib.sha256(weights.get().tobytes()).hexdigest()
        args.output.mkdir(parents=True, exist_ok=True)
        with open(args.output / f"rank-{group.rank}.jsonl", "a") as f:
            f.write(json.dumps(dict(step=step, weights_sha256=digest)) + "\n")


if __name__ == "__main__":
    sys.exit(main())
