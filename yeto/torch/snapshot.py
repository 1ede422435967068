"""A push's snapshot of a CUDA model's weights, taken without the training loop
waiting: the trainable values of a range are copied on the device (kernels queued on
the training stream, so they run before the next optimizer step changes the
weights, and the host goes on at once), then read back to the host by the push's
background encode on a side stream, through a pinned staging buffer of its own.

It costs the GPU 4 B per parameter of the range while the push is encoded (freed
when the encode is done) and the host nothing beyond the staging buffer. Read-only:
the island's staging reads it like the weights (`read_range`) and writes nothing
back."""

from __future__ import annotations

import numpy as np
import torch

STAGING = 1 << 20  # values per transfer back to the host


class DeviceSnapshot:
    """Values [lo, hi) of the flat view of `parts`: (flat start, CUDA tensor) pairs of
    `yeto.torch.weights.TorchWeights`, copied on their device now."""

    def __init__(self, parts, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        device = parts[0][1].device
        with torch.no_grad():
            self.copies = [(start, t.detach().reshape(-1).clone()) for start, t in parts]
        self.ready = torch.cuda.Event()
        self.ready.record(torch.cuda.current_stream(device))
        self.stream = torch.cuda.Stream(device)
        self.staging: torch.Tensor | None = None  # made by the reader (the background)

    def read_range(self, lo: int, hi: int) -> np.ndarray:
        """Values [lo, hi) as a new float32 array (bf16/fp16 widened exactly)."""
        if not self.lo <= lo <= hi <= self.hi:
            raise ValueError(f"range [{lo}, {hi}) outside the snapshot's [{self.lo}, {self.hi})")
        out = np.empty(hi - lo, dtype=np.float32)
        if self.staging is None:
            self.staging = torch.empty(STAGING, dtype=torch.float32, pin_memory=True)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.ready)
            for start, t in self.copies:
                a, b = max(lo, start), min(hi, start + t.numel())
                for x in range(a, b, STAGING):
                    y = min(x + STAGING, b)
                    stage = self.staging[:y - x]
                    stage.copy_(t[x - start:y - start], non_blocking=True)
                    self.stream.synchronize()
                    out[x - lo:y - lo] = stage.numpy()
        return out
