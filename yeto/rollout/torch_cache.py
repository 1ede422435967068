"""Rows' transformers caches merged into one batch, and rows dropped from it.

`new_cache` makes the cache a prompt is prefilled into alone: a plain
`DynamicCache` for attention-only models, one built from the model's config where
some layers keep a conv or recurrent state instead of (or beside) keys and values:
LFM2's short-conv blocks, the mamba blocks of Granite-4.0-H, Falcon-H1, Nemotron-H,
the gated-delta blocks of Qwen3-Next.

`merge` stacks the rows' caches along the batch. Keys and values are left-padded
with zeros to the longest row (the attention mask hides them). A conv or recurrent
state has no sequence axis: each row's is what its prompt alone left there, so
stacking them is exact, and no padded position ever passes through a convolution
or a state update (decode feeds every row a real token at every step).
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import (
    DummyLayer,
    DynamicCache,
    DynamicLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)


def new_cache(config) -> DynamicCache:
    """An empty cache for one prompt of a model with this config; ValueError for a
    model whose cache cannot be batched exactly."""
    cache = DynamicCache(config=config)
    if not any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers):
        return DynamicCache()  # attention only: every layer keeps all its keys
    for i, layer in enumerate(cache.layers):
        _check_kind(layer, i)
    return cache


def _check_kind(layer, i: int) -> None:
    kv_ok = type(layer) in (DynamicLayer, DummyLayer) or isinstance(layer, LinearAttentionLayer)
    sliding = getattr(layer, "is_sliding", False)
    if not kv_ok or sliding:
        raise ValueError(
            f"this model cannot be sampled in batches on torch yet: layer {i} keeps a "
            f"{type(layer).__name__} beside conv / state-space layers (batched are full "
            f"attention, conv and state-space layers, not sliding or indexed attention "
            f"in a hybrid); serve it with another engine (e.g. vLLM)")


def _has_kv(layer) -> bool:
    """Whether `layer` holds keys and values (full attention, alone or beside a
    linear-attention state)."""
    return isinstance(layer, DynamicLayer) and getattr(layer, "is_initialized", False) \
        and layer.keys is not None and layer.keys.numel() > 0


def _stack_states(rows: list, attr: str, n: int) -> dict:
    first = getattr(rows[0], attr)
    return {i: None if first[i] is None else torch.cat([getattr(r, attr)[i] for r in rows])
            for i in range(n)}


def _merge_layer(rows: list, lengths: list[int], length: int):
    """One layer of the batch from the same layer of each row (`lengths`: the rows'
    token counts; keys and values are left-padded to `length`)."""
    merged = copy.copy(rows[0])  # same kind and settings; every tensor replaced below
    if _has_kv(rows[0]):
        padded: dict[int, tuple] = {}
        for r, n in zip(rows, lengths):  # rows of one prompt share its layer: pad it once
            if id(r) not in padded:
                pad = (0, 0, length - n, 0)
                padded[id(r)] = (torch.nn.functional.pad(r.keys, pad),
                                 torch.nn.functional.pad(r.values, pad))
        merged.keys = torch.cat([padded[id(r)][0] for r in rows])
        merged.values = torch.cat([padded[id(r)][1] for r in rows])
    if isinstance(rows[0], LinearAttentionCacheLayerMixin):
        n = rows[0].number_of_states
        merged.conv_states = _stack_states(rows, "conv_states", n)
        merged.recurrent_states = _stack_states(rows, "recurrent_states", n)
        for attr in ("is_conv_states_initialized", "is_recurrent_states_initialized",
                     "has_previous_state", "conv_kernel_size"):
            setattr(merged, attr, dict(getattr(rows[0], attr)))
    return merged


def merge(caches: list[DynamicCache], lengths: list[int]) -> DynamicCache:
    """One cache holding `caches` (one per row, a row's prompt `lengths[j]` tokens) as
    rows of a batch, keys left-padded to the longest. Rows of one prompt may share a
    cache object; the inputs are not changed."""
    length = max(lengths)
    batch = copy.copy(caches[0])
    batch.layers = [_merge_layer([c.layers[i] for c in caches], lengths, length)
                    for i in range(len(caches[0].layers))]
    return batch


def has_keys(cache: DynamicCache) -> bool:
    """Whether any layer of `cache` holds keys (so a padding mask means something to
    the model). Pure state-space models (Mamba, Falcon-Mamba) hand a 2-D mask
    straight to their mixers, which would broadcast one decode step over it."""
    return any(_has_kv(layer) for layer in cache.layers)


def select(cache: DynamicCache, idx: torch.Tensor) -> None:
    """Keep only rows `idx` (a 1-D index tensor) of every layer, in place."""
    for layer in cache.layers:
        if _has_kv(layer):
            layer.keys, layer.values = layer.keys[idx], layer.values[idx]
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for states in (layer.conv_states, layer.recurrent_states):
                for i, s in states.items():
                    if s is not None:
                        states[i] = s[idx]
