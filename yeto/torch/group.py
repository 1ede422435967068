"""An island as a torchrun group: N data-parallel processes, one learner id.

    torchrun --nproc-per-node 2 -m yeto.learner --syncer HOST:PORT ...

Every rank trains on its own slice of the island's data shard with DDP (gloo on
CPU, NCCL on GPUs), so all ranks take identical optimizer steps. Only rank 0
talks to the syncer; after each step it tells the others, in one small
broadcast, whether merged weights were applied (then the weights follow, tensor
by tensor, straight into the parameters) and whether the run is over. Loss tokens
are summed over ranks, so the syncer counts the island once with all of its tokens.

With `--fsdp` the ranks shard the model instead (`yeto.torch.fsdp`).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist

from yeto.island.weights import Weights
from yeto.torch.weights import TorchWeights

log = logging.getLogger("yeto.torch.group")


@dataclass(frozen=True)
class TorchGroup:
    """The ranks of one torchrun island (`yeto.loop.Solo` is the one-process case)."""

    rank: int = 0
    world: int = 1
    sharded: ClassVar[bool] = False

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def sum(self, value: int) -> int:
        """`value` summed over all ranks."""
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t)
        return int(t.item())

    def island_weights(self, weights):
        return weights

    def collective(self, fn):
        return fn

    def share(self, applied: bool, weights: TorchWeights, done: bool = False
              ) -> tuple[bool, bool]:
        """Rank 0's (applied, done) go to every rank; when rank 0 applied merged
        weights, its trainable weights follow and every other rank sets them.
        Returns (done, applied)."""
        if not self.active:
            return done, applied
        applied, done = self._flags(applied, done)
        if applied:
            broadcast_weights(weights)
        return done, applied

    def _flags(self, applied: bool, done: bool) -> tuple[bool, bool]:
        flags = torch.tensor([int(applied), int(done)], dtype=torch.int64)
        dist.broadcast(flags, src=0)
        return bool(flags[0]), bool(flags[1])

    def record_weights(self, out: Path, step: int | str, weights: Weights) -> None:
        """Each rank notes a digest of its weights after a merge (rank-N.jsonl), so a
        test can see that every rank holds the same weights."""
        digest = weights.digest()
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"rank-{self.rank}.jsonl", "a") as f:
            f.write(json.dumps(dict(step=step, weights_sha256=digest)) + "\n")

    def close(self) -> None:
        """Tear the group down once every rank got here. Call it after the model is
        released (`Backend.release`): a group destroyed while sharded tensors still held
        it made gloo abort the process at exit under load ("terminate called without an
        active exception", SIGABRT; tests/e2e/test_fsdp.py)."""
        if self.active and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def broadcast_weights(weights: TorchWeights) -> None:
    """Rank 0's trainable weights onto every rank, tensor by tensor in place (no copy)."""
    with torch.no_grad():
        for t in weights.tensors():
            dist.broadcast(t.detach(), src=0)


def init_group(device: torch.device, timeout_s: float = 1800,
               kind: type[TorchGroup] | None = None) -> TorchGroup:
    """Join the torchrun group described by the environment (a no-op without one).
    `kind`: the group's class (default `TorchGroup`; `yeto.torch.fsdp.FSDPGroup` when
    the ranks shard the model)."""
    kind = kind or TorchGroup
    sharded = kind.sharded
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        if sharded:
            log.info("--fsdp in a single process: nothing to shard over; training unsharded")
        return TorchGroup()
    # CPU tensors (flags, counts, commands) go over gloo, CUDA tensors over NCCL
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # FSDP and NCCL use the current device
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    extra = {"device": device} if sharded else {}
    group = kind(dist.get_rank(), dist.get_world_size(), **extra)
    log.info("rank %d of %d (%s%s)", group.rank, group.world, backend,
             ", FSDP" if sharded else "")
    return group


def local_device(requested: str) -> torch.device:
    if requested != "auto":
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
