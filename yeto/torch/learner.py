"""The torch island: `python -m yeto.learner` (or `python -m yeto.torch.learner`).

Fine-tunes a Hugging Face causal LM (peft LoRA, or full weights) on its shard of
the data and takes part in a DiLoCo run. `TorchBackend` is the torch edge; the
loop, syncing, signals, metrics and outputs are `yeto.loop.run_island`'s.

Example (with a syncer on 127.0.0.1:29400, two islands):
    python -m yeto.learner --model runs/demo/model --data runs/demo/data/train.jsonl \\
        --eval-data runs/demo/data/eval.jsonl --syncer 127.0.0.1:29400 \\
        --learner-id island-0 --num-learners 2 --max-steps 200 --output runs/island-0

Several processes (or GPUs) as one island: `torchrun --nproc-per-node N -m yeto.learner`
(data-parallel, DDP), or with `--fsdp` sharding the model across them (FSDP2; see
`yeto.torch.fsdp`) for models that do not fit one device.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from yeto.config import D, IslandConfig, add_island_args, parse_island_args
from yeto.loop import run_island
from yeto.torch import group as torch_group
from yeto.torch.loss import evaluate, train_step
from yeto.torch.model import attach_lora, export_files, load_base, save_output
from yeto.torch.weights import TorchWeights


def _fsdp_group():
    from yeto.torch.fsdp import FSDPGroup  # torch.distributed.fsdp: only when sharding

    return FSDPGroup


def guard_optimizer(opt, before_update) -> bool:
    """Run the island's guard (`Island.before_update`) right before each step of the
    torch optimizer ``opt`` (a step pre-hook), so that a push may be staged while the
    next forward and backward run; True (installed)."""
    opt.register_step_pre_hook(lambda *_: before_update())
    return True


class TorchBackend:
    """The torch edge of an island (`yeto.loop.Backend`): a torchrun group of ranks
    training data-parallel (DDP) or sharded (FSDP2, `--fsdp`), or one process."""

    name = "torch"

    def __init__(self, cfg: IslandConfig):
        self.device = torch_group.local_device(cfg.device)
        # torchrun: N processes, one island
        self.group = torch_group.init_group(self.device, kind=_fsdp_group() if cfg.fsdp
                                            else None)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        self.model = self.tokenizer = self.opt = self.stepper = None

    def load(self, cfg: IslandConfig, source):
        self.model, self.tokenizer = load_base(source)
        return self.tokenizer

    def release(self) -> None:
        """Drop the model and its optimizer (the run is over and saved)."""
        self.model = self.opt = self.stepper = None

    def attach(self, cfg: IslandConfig):
        if cfg.tuning == "lora":
            self.model = attach_lora(self.model, cfg.lora_r, cfg.lora_alpha, cfg.lora_targets,
                                     cfg.seed, freeze_a=cfg.lora_freeze_a)
        if self.group.sharded:  # FSDP2 moves each layer's shards to the device
            from yeto.torch.fsdp import ShardedWeights, shard_model

            shard_model(self.model, self.group).train()
            weights = ShardedWeights(self.model, cfg.tuning, self.group)
        else:
            self.model.to(self.device).train()
            weights = TorchWeights(self.model, cfg.tuning)
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad],
                                     lr=cfg.inner_lr, weight_decay=cfg.weight_decay)
        self.stepper = self.model
        if self.group.active and not self.group.sharded:  # identical steps: DDP averages
            self.stepper = torch.nn.parallel.DistributedDataParallel(self.model,
                                                                     broadcast_buffers=False)
        return weights

    def export_files(self, cfg: IslandConfig) -> tuple[str, dict[str, str]]:
        return export_files(self.model, cfg.tuning, cfg.seed if cfg.lora_freeze_a else None)

    def train_step(self, micro_batches) -> tuple[float, int]:
        return train_step(self.stepper, self.opt, micro_batches, self.device)

    def guard_updates(self, before_update) -> bool:
        """Run the island's guard right before each optimizer step (a step pre-hook),
        so its push may be staged while forward and backward run. Not for FSDP: there
        a range read of the weights is a collective of every rank."""
        if self.group.sharded:
            return False
        return guard_optimizer(self.opt, before_update)

    def evaluate(self, blocks, batch_size: int) -> float:
        return evaluate(self.model, blocks, batch_size, self.device)

    def save(self, cfg: IslandConfig, out: Path) -> Path:
        """The adapter or model (rank 0 writes; every rank of an FSDP island takes part
        in gathering it, one tensor at a time)."""
        saved = out / "adapter" if cfg.tuning == "lora" else out / "model"
        if not self.group.sharded:
            save_output(self.model, saved, cfg.tuning, self.tokenizer)
            return saved
        from yeto.torch.fsdp import gather_state_dict

        lora = cfg.tuning == "lora"
        state = gather_state_dict(self.model, (lambda n: "lora_" in n) if lora else
                                  (lambda n: True))
        if self.group.leader:
            saved.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(saved, safe_serialization=True, state_dict=state)
            if not lora and self.tokenizer is not None:
                self.tokenizer.save_pretrained(saved)
        return saved

    def describe(self) -> str:
        return f"torch {self.device}"


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
    p.add_argument("--tuning", choices=("lora", "full"), default=D.tuning,
                   help="train LoRA adapters, or all weights")
    p.add_argument("--device", default=D.device, help="auto | cpu | cuda | cuda:N")
    p.add_argument("--threads", type=int, default=D.threads,
                   help="torch CPU threads (0 = torch default)")
    p.add_argument("--fsdp", action="store_true",
                   help="under torchrun: shard the model across the ranks (FSDP2, each decoder "
                        "layer and the root) instead of replicating it (DDP); rank 0 syncs, "
                        "gathering one tensor at a time")
    return p


def main(argv=None) -> int:
    cfg = parse_island_args(build_parser(), argv)
    return run_island(cfg, TorchBackend(cfg))


if __name__ == "__main__":
    sys.exit(main())
