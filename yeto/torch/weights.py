"""The trainable tensors of a torch model under canonical names, as one flat float32
vector: the island's view of the model (`yeto.island.Weights`).

Range access (`read_range` / `write_range`) goes tensor by tensor, straight between
the parameters and the island's host arrays: no flat copy of the model is made. On
CUDA each piece crosses the bus through one reused pinned staging buffer, so the
island's anchor and residual stay in host memory and nothing of the island's is
ever allocated on the GPU.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

import numpy as np
import torch

from yeto.island.weights import Weights
from yeto.layout import Layout
from yeto.torch.model import canonical_name

STAGING = 1 << 20  # values in the pinned staging buffer (CUDA)


class TorchWeights(Weights):
    """`get()` / `set(flat)` and `read_range(lo, hi)` / `write_range(lo, hi, values)` in
    the layout's canonical order (peft names for LoRA, the Hugging Face names in full
    mode)."""

    ranged = True

    def __init__(self, model: torch.nn.Module, tuning: str):
        self.params: dict[str, torch.nn.Parameter] = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                self.params[canonical_name(name, tuning)] = p
        self.layout = Layout.from_shapes({k: tuple(p.shape) for k, p in self.params.items()})
        self._ordered = [self.params[s.name] for s in self.layout.specs]
        self._starts = [self.layout.offsets[s.name][0] for s in self.layout.specs]
        self._staging: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        """The trainable parameters in canonical order."""
        return list(self._ordered)

    def get(self) -> np.ndarray:
        return self.read_range(0, self.layout.numel)

    def set(self, flat: np.ndarray) -> None:
        # Not torch's vector_to_parameters: it rebinds each `param.data` to a view of
        # the incoming vector (aliasing the caller's array, changing the dtype of
        # bf16/fp16 parameters); copy_ keeps each parameter's storage and dtype.
        flat = np.asarray(flat, dtype=np.float32)
        if flat.shape != (self.layout.numel,):
            raise ValueError(f"flat vector has {flat.size} elements, layout has "
                             f"{self.layout.numel}")
        self.write_range(0, self.layout.numel, flat)

    def read_range(self, lo: int, hi: int) -> np.ndarray:
        """Values [lo, hi) of the flat view, as a new float32 array."""
        out = np.empty(hi - lo, dtype=np.float32)
        with torch.no_grad():
            for p, a, b, at in self._spans(lo, hi):
                src = _flat(p)[a:b]
                dst = torch.from_numpy(out[at:at + b - a])
                if src.is_cuda:
                    stage = self._stage(b - a)
                    stage.copy_(src)
                    dst.copy_(stage)
                else:
                    dst.copy_(src)  # also widens bf16/fp16 exactly
        return out

    def write_range(self, lo: int, hi: int, values: np.ndarray) -> None:
        """Set values [lo, hi) of the flat view (each parameter keeps its dtype)."""
        values = np.asarray(values, dtype=np.float32).reshape(-1)
        if values.size != hi - lo:
            raise ValueError(f"{values.size} values for the range [{lo}, {hi})")
        if not values.flags.writeable:  # torch.from_numpy wants a writeable array
            values = values.copy()
        with torch.no_grad():
            for p, a, b, at in self._spans(lo, hi):
                src = torch.from_numpy(values[at:at + b - a])
                if p.is_cuda:
                    stage = self._stage(b - a)
                    stage.copy_(src)
                    src = stage
                if p.is_contiguous():
                    p.detach().view(-1)[a:b].copy_(src)
                else:  # rare: write through a contiguous copy of the tensor
                    whole = p.detach().reshape(-1).clone()
                    whole[a:b].copy_(src)
                    p.detach().copy_(whole.view(p.shape))

    def snapshot(self, lo: int, hi: int):
        """A copy of values [lo, hi) taken on the GPU without the host waiting
        (`yeto.torch.snapshot.DeviceSnapshot`), or None for a model not on CUDA."""
        parts = [(at + lo - a, p) for p, a, b, at in self._spans(lo, hi)]
        if not parts or not all(p.is_cuda for _, p in parts):
            return None
        from yeto.torch.snapshot import DeviceSnapshot

        return DeviceSnapshot(parts, lo, hi)

    def _spans(self, lo: int, hi: int) -> Iterator[tuple[torch.Tensor, int, int, int]]:
        """(parameter, start, stop within it, position in [lo, hi)) for every parameter
        the range touches."""
        if not 0 <= lo <= hi <= self.layout.numel:
            raise ValueError(f"range [{lo}, {hi}) outside 0..{self.layout.numel}")
        i = max(0, bisect.bisect_right(self._starts, lo) - 1)
        while i < len(self._ordered) and self._starts[i] < hi:
            p, start = self._ordered[i], self._starts[i]
            a, b = max(lo, start) - start, min(hi, start + p.numel()) - start
            if b > a:
                yield p, a, b, start + a - lo
            i += 1

    def _stage(self, n: int) -> torch.Tensor:
        """A pinned host buffer of n float32 values (reused), for CUDA transfers."""
        if self._staging is None or self._staging.numel() < n:
            self._staging = torch.empty(max(n, STAGING), dtype=torch.float32,
                                        pin_memory=True)
        return self._staging[:n]


def _flat(p: torch.Tensor) -> torch.Tensor:
    t = p.detach()
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)
