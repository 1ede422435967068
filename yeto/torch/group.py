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
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger("yeto.torch.group")


@dataclass(frozen=True)
class TorchGroup:
    """The ranks of one torchrun island (`yeto.loop.Solo` is the one-process case)."""

    rank: int = 0
    world: int = 1

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

    def share(self, applied: bool, weights, done: bool = False) -> tuple[bool, bool]:
        """Rank 0's (applied, done) go to every rank; when rank 0 applied merged
        weights, its trainable weights follow and every other rank sets them.
        Returns (done, applied)."""
        if not self.active:
            return done, applied
        flags = torch.tensor([int(applied), int(done)], dtype=torch.int64)
        dist.broadcast(flags, src=0)
        applied, done = bool(flags[0]), bool(flags[1])
        if applied:
            buf = torch.from_numpy(np.ascontiguousarray(weights.get())) if self.leader else \
                torch.empty(weights.layout.numel, dtype=torch.float32)
            dist.broadcast(buf, src=0)
            if not self.leader:
                weights.set(buf.numpy())
        return done, applied

    def record_weights(self, out: Path, step: int, weights) -> None:
        """Each rank notes a digest of its weights after a merge (rank-N.jsonl), so a
        test can see that every rank holds the same weights."""
        digest = hashlib.sha256(weights.get().tobytes()).hexdigest()
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"rank-{self.rank}.jsonl", "a") as f:
            f.write(json.dumps(dict(step=step, weights_sha256=digest)) + "\n")

    def close(self) -> None:
        if self.active and dist.is_initialized():
            dist.destroy_process_group()


def init_group(device: torch.device, timeout_s: float = 1800) -> TorchGroup:
    """Join the torchrun group described by the environment (a no-op without one)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return TorchGroup()
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    group = TorchGroup(dist.get_rank(), dist.get_world_size())
    log.info("rank %d of %d (%s)", group.rank, group.world, backend)
    return group


def local_device(requested: str) -> torch.device:
    if requested != "auto":
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
