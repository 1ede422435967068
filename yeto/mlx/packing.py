"""Document-packed blocks on the MLX island: each token attends only to earlier
tokens of its own document.

mlx-lm models take no attention-mask argument: they build a causal mask from the KV
cache they are given (``cache.make_mask``). `document_cache` hands the block-diagonal
causal mask of a packed block (`yeto.data.attention_mask`) in through that cache
protocol, one `MaskCache` per layer. Positions stay 0..T-1 through the block: RoPE
makes q·k depend only on the distance between tokens, and with the mask tokens only
meet tokens of their own document, so this equals restarting positions at every
document start (as the torch island does with ``position_ids``).
"""

from __future__ import annotations


class MaskCache:
    """Stands in for an mlx-lm KV cache during one full-sequence forward pass: it
    caches nothing, and its ``make_mask`` returns the given mask (bool, True = may
    attend, broadcastable to (batch, heads, T, T))."""

    offset = 0

    def __init__(self, mask):
        self.mask = mask

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        import mlx.core as mx

        if self.mask.shape[-1] != n:
            raise ValueError(f"mask is for {self.mask.shape[-1]} tokens, the input has {n}")
        if window_size is not None and n > window_size:
            idx = mx.arange(n)
            return self.mask & ((idx[:, None] - idx[None, :]) < window_size)
        return self.mask

    def update_and_fetch(self, keys, values):
        return keys, values


def document_cache(model, mask) -> list[MaskCache]:
    """The ``cache=`` argument that makes an mlx-lm model attend with ``mask``."""
    return [MaskCache(mask) for _ in range(len(model.layers))]
