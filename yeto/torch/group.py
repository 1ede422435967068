"""An island as a torchrun group: N data-parallel processes, one learner id.

    torchrun --nproc-per-node 2 -m yeto.learner --syncer HOST:PORT ...

Every rank trains on its own slice of the island's data shard with DDP (gloo on
CPU, NCCL on GPUs), so all ranks take identical optimizer steps. Only rank 0
talks to the syncer; after each step it tells the others, in one small
broadcast, whether merged weights were applied (then the weights follow in a
second broadcast) and whether the run is over. Loss tokens are summed over
ranks, so the syncer counts the island once with all of its tokens.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger("yeto.torch.group")


@dataclass(frozen=True)
class Group:
    rank: int = 0
    world: int = 1

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


def init_group(device: torch.device, timeout_s: float = 1800) -> Group:
    """Join the torchrun group described by the environment (a no-op without one)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Group()
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    group = Group(dist.get_rank(), dist.get_world_size())
    log.info("rank %d of %d (%s)", group.rank, group.world, backend)
    return group


def local_device(requested: str) -> torch.device:
    if requested != "auto":
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def sum_over_ranks(group: Group, value: int) -> int:
    if not group.active:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def share_weights(group: Group, applied: bool, get_weights, set_weights, numel: int,
                  done: bool = False) -> tuple[bool, bool]:
    """Rank 0's (applied, done) go to every rank; when rank 0 applied merged weights,
    its trainable weights follow and every other rank sets them. Returns (done, applied)."""
    if not group.active:
        return done, applied
    flags = torch.tensor([int(applied), int(done)], dtype=torch.int64)
    dist.broadcast(flags, src=0)
    applied, done = bool(flags[0]), bool(flags[1])
    if applied:
        buf = torch.from_numpy(np.ascontiguousarray(get_weights())) if group.leader else \
            torch.empty(numel, dtype=torch.float32)
        dist.broadcast(buf, src=0)
        if not group.leader:
            set_weights(buf.numpy())
    return done, applied


def close(group: Group) -> None:
    if group.active and dist.is_initialized():
        dist.destroy_process_group()
