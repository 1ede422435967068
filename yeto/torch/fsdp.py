"""An island whose ranks shard the model with FSDP2 (`fully_shard`):

    torchrun --nproc-per-node N -m yeto.learner --fsdp --syncer HOST:PORT ...

Each decoder layer and the root are sharded across the N ranks (gloo on CPU, NCCL
on GPUs), so the island can train a model that does not fit one device; full
weights or LoRA. Every rank trains on its own slice of the island's data and FSDP
averages the gradients, as DDP would.

Sync stays per island: rank 0 runs the island and talks to the syncer. Its view of
the flat weights (`ShardedWeights`) gathers and scatters one tensor at a time: a
range read gathers the tensor it falls in (`full_tensor()`, kept while the island
reads on in it), a range write fills it and scatters it back into every rank's
shard (`distribute_tensor` from rank 0, copied into the local shard) when the
island moves on or the pass ends. The other ranks take part through a small
command protocol: while rank 0's island works they wait in `FSDPGroup.share`,
serving "gather tensor i", "scatter tensor i" and "run collective call k" (the
held-out evaluation, which needs every rank) until rank 0 says done. So the
memory a sync needs beyond the island's own host arrays is one tensor, gathered,
never the whole model. The island's anchor and residual live on rank 0's host.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from yeto.island.weights import Weights
from yeto.layout import Layout
from yeto.torch.group import TorchGroup
from yeto.torch.model import canonical_name

DONE, GATHER, SCATTER, CALL = 0, 1, 2, 3


@dataclass(frozen=True)
class FSDPGroup(TorchGroup):
    """The ranks of one FSDP island: rank 0 leads, the others serve its commands."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    calls: list = field(default_factory=list, compare=False)
    sharded: ClassVar[bool] = True

    def collective(self, fn):
        """`fn` run on every rank when rank 0 calls the returned function (registered in
        the same order on every rank); rank 0 gets fn's result."""
        k = len(self.calls)
        self.calls.append(fn)

        def on_leader():
            self.command(CALL, k)
            return fn()

        return on_leader

    def command(self, op: int, arg: int = 0) -> None:
        """Rank 0: tell the serving ranks what to take part in next."""
        dist.broadcast(torch.tensor([op, arg], dtype=torch.int64), src=0)

    def serve(self, weights: ShardedWeights) -> None:
        """Other ranks: take part in rank 0's gathers, scatters and calls until done."""
        while True:
            cmd = torch.empty(2, dtype=torch.int64)
            dist.broadcast(cmd, src=0)
            op, arg = int(cmd[0]), int(cmd[1])
            if op == DONE:
                return
            if op == GATHER:
                weights.gather(arg)
            elif op == SCATTER:
                weights.scatter(arg, None)
            elif op == CALL:
                self.calls[arg]()
            else:
                raise RuntimeError(f"unknown FSDP island command {op}")

    def share(self, applied: bool, weights, done: bool = False) -> tuple[bool, bool]:
        """Rank 0 ends the turn's commands; the others serve until then. The weights
        are already in every shard (scattered as written). Returns (done, applied)."""
        if self.leader:
            self.command(DONE)
        else:
            self.serve(weights)
        applied, done = self._flags(applied, done)
        return done, applied


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one: the classes a Hugging Face model names
    in `_no_split_modules`, else the children of its largest ModuleList."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def shard_model(model: torch.nn.Module, group: FSDPGroup) -> torch.nn.Module:
    """FSDP2 over the group's ranks: each decoder layer, then the root. Parameters move
    to the group's device (one layer at a time) and become DTensor shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(group.device.type, (group.world,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class ShardedWeights(Weights):
    """The trainable tensors of an FSDP2 model as the island's flat float32 view
    (`yeto.island.Weights` with range access). Range reads and writes are for rank 0's
    island while the other ranks serve (`FSDPGroup.serve`); `gather`, `scatter` and
    `digest` are collective (every rank calls them)."""

    ranged = True

    def __init__(self, model: torch.nn.Module, tuning: str, group: FSDPGroup):
        self.group = group
        params = {canonical_name(n, tuning): p for n, p in model.named_parameters()
                  if p.requires_grad}
        self.layout = Layout.from_shapes({k: tuple(p.shape) for k, p in params.items()})
        self._ordered = [params[s.name] for s in self.layout.specs]
        self._starts = [self.layout.offsets[s.name][0] for s in self.layout.specs]
        self._held: tuple[int, np.ndarray] | None = None  # (tensor index, its full values)
        self._dirty = False

    # ---- rank 0's range access -------------------------------------------------
    def read_range(self, lo: int, hi: int) -> np.ndarray:
        out = np.empty(hi - lo, dtype=np.float32)
        for i, a, b, at in self._spans(lo, hi):
            out[at:at + b - a] = self._tensor(i, gather=True)[a:b]
        return out

    def write_range(self, lo: int, hi: int, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.float32).reshape(-1)
        for i, a, b, at in self._spans(lo, hi):
            whole = a == 0 and b == self._ordered[i].numel()
            self._tensor(i, gather=not whole)[a:b] = values[at:at + b - a]
            self._dirty = True

    def flush(self) -> None:
        """End of a pass: scatter the tensor written last; forget the gathered one (the
        shards change with the next step)."""
        if self._held is not None and self._dirty and self.group.leader:
            i, full = self._held
            self.group.command(SCATTER, i)
            self.scatter(i, full)
        self._held, self._dirty = None, False

    def get(self) -> np.ndarray:
        try:
            return self.read_range(0, self.layout.numel)
        finally:
            self.flush()

    def set(self, flat: np.ndarray) -> None:
        self.write_range(0, self.layout.numel, flat)
        self.flush()

    def _tensor(self, i: int, gather: bool) -> np.ndarray:
        """Tensor i's full values on rank 0 (gathered, or fresh when all of it is about
        to be written), scattering the one held before if it was written."""
        if self._held is not None and self._held[0] == i:
            return self._held[1]
        self.flush()
        if gather:
            self.group.command(GATHER, i)
            full = self.gather(i)
        else:
            full = np.empty(self._ordered[i].numel(), dtype=np.float32)
        self._held = (i, full)
        return full

    def _spans(self, lo: int, hi: int):
        i = max(0, bisect.bisect_right(self._starts, lo) - 1)
        while i < len(self._ordered) and self._starts[i] < hi:
            start = self._starts[i]
            a, b = max(lo, start) - start, min(hi, start + self._ordered[i].numel()) - start
            if b > a:
                yield i, a, b, start + a - lo
            i += 1

    # ---- collective ------------------------------------------------------------
    def gather(self, i: int) -> np.ndarray:
        """Tensor i gathered from every rank's shard, as flat float32 on the host."""
        p = self._ordered[i]
        with torch.no_grad():
            full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            return full.to(dtype=torch.float32).reshape(-1).cpu().numpy()

    def scatter(self, i: int, flat: np.ndarray | None) -> None:
        """Rank 0's values of tensor i (`flat`; None on the other ranks) into every
        rank's shard, in the parameter's dtype."""
        p = self._ordered[i]
        device = p.to_local().device if isinstance(p, DTensor) else p.device
        with torch.no_grad():
            if self.group.leader:
                full = torch.from_numpy(np.ascontiguousarray(flat)).view(p.shape)
                full = full.to(device=device, dtype=p.dtype)
            else:
                full = torch.empty(p.shape, dtype=p.dtype, device=device)
            if isinstance(p, DTensor):
                shard = distribute_tensor(full, p.device_mesh, p.placements)  # from rank 0
                p.to_local().copy_(shard.to_local())
            else:
                dist.broadcast(full, src=0)
                p.copy_(full)

    def digest(self) -> str:
        """SHA-256 of the gathered flat weights in canonical order (collective)."""
        h = hashlib.sha256()
        for i in range(len(self._ordered)):
            h.update(self.gather(i).tobytes())
        return h.hexdigest()


def gather_state_dict(model: torch.nn.Module, keep=lambda name: True) -> dict:
    """The model's state dict with every shard gathered (collective); full CPU tensors
    on rank 0, nothing elsewhere. One tensor is gathered at a time."""
    leader = dist.get_rank() == 0
    out = {}
    for name, t in model.state_dict().items():
        if not keep(name):
            continue
        with torch.no_grad():
            full = t.full_tensor() if isinstance(t, DTensor) else t
            if leader:
                out[name] = full.detach().cpu().clone()
    return out
