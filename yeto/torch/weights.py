"""The trainable tensors of a torch model under canonical names, as one flat float32
vector: the island's view of the model (`yeto.loop.Weights`)."""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.utils import parameters_to_vector

from yeto.layout import Layout
from yeto.torch.model import canonical_name


class TorchWeights:
    """`get()` / `set(flat)` in the layout's canonical order (peft names for LoRA, the
    Hugging Face names in full mode)."""

    def __init__(self, model: torch.nn.Module, tuning: str):
        self.params: dict[str, torch.nn.Parameter] = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                self.params[canonical_name(name, tuning)] = p
        self.layout = Layout.from_shapes({k: tuple(p.shape) for k, p in self.params.items()})
        self._ordered = [self.params[s.name] for s in self.layout.specs]

    def get(self) -> np.ndarray:
        with torch.no_grad():
            flat = parameters_to_vector(p.detach().float() for p in self._ordered)
        return flat.cpu().numpy().copy()

    def set(self, flat: np.ndarray) -> None:
        # Not torch's vector_to_parameters: it rebinds each `param.data` to a view of
        # the incoming vector (aliasing the caller's array, changing the dtype of
        # bf16/fp16 parameters); copy_ keeps each parameter's storage and dtype.
        src = torch.from_numpy(np.ascontiguousarray(flat, dtype=np.float32))
        with torch.no_grad():
            pos = 0
            for p in self._ordered:
                n = p.numel()
                p.copy_(src[pos:pos + n].view_as(p))
                pos += n
