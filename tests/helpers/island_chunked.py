"""What the island chunked tests in more than one tier share."""

import numpy as np


class FlatWeights:
    """get/set only (like the MLX LoRA view): the island falls back to whole arrays."""

    def __init__(self, layout, init):
        self.layout, self.v = layout, init.copy()

    def get(self):
        return self.v.copy()

    def set(self, flat):
        self.v = np.array(flat, dtype=np.float32)


class RangedWeights(FlatWeights):
    """A numpy model with range access, counting flushes."""

    flushes = 0

    def read_range(self, lo, hi):
        return self.v[lo:hi].copy()

    def write_range(self, lo, hi, values):
        self.v[lo:hi] = values

    def flush(self):
        self.flushes += 1
