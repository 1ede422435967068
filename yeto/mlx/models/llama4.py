"""Llama 4's attention plan per layer, read from the config where mlx-lm hard-codes it.

transformers' Llama 4 reads, per layer, whether attention rotates (``no_rope_layers``:
1 = RoPE) and how far it looks (``layer_types``: ``chunked_attention``, within the
token's chunk of ``attention_chunk_size`` tokens, or ``full_attention``); any order,
any number of layers. mlx_lm/models/llama4.py hard-codes one plan instead: RoPE and
chunked attention in every layer but each 4th, which attends globally without RoPE,
with the global mask taken from layer 3's cache (so at least 4 layers).

`follow_config` makes the built model follow the config's plan:

- each layer's attention is built again as mlx-lm builds a layer of its RoPE kind
  (``Attention(args, layer_idx)`` decides RoPE by ``layer_idx`` only: index 0 rotates,
  index 3 does not), which carries what goes with it in transformers too: the QK norm
  on rotating layers only, attention temperature tuning on the others;
- the QK norm uses the config's ``rms_norm_eps`` (transformers' ``Llama4TextL2Norm``)
  where mlx-lm's hard-codes 1e-6 (`_ThenQKNorm`);
- each layer gets the mask of its own kind from its own cache (`_call`), and the
  model's caches follow the plan (`_make_cache`: ``ChunkedKVCache`` for chunked
  layers, ``KVCache`` for full ones).

It runs on the built model after `yeto.mlx.layer_kinds` has rebuilt layers for the MoE
plan and before `yeto.mlx.rope.fix_rope` (which scales the rebuilt RoPE modules).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from yeto.mlx.errors import UnsupportedConfig

#: model types whose mlx-lm file hard-codes Llama 4's plan (llama4_text loads into it)
PLANNED = {"llama4", "llama4_text"}
_CHUNKED, _FULL = "chunked_attention", "full_attention"


def plan(config: dict[str, Any]) -> tuple[list[bool], list[bool]] | None:
    """(rotates, chunked) per layer as transformers' Llama4TextConfig reads them (its
    defaults where the config leaves them out), or None for another model type."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    if config.get("model_type") not in PLANNED or not isinstance(text, dict):
        return None
    n = text["num_hidden_layers"]
    rope = text.get("no_rope_layers") or [int((i + 1) % text.get("no_rope_layer_interval", 4) != 0)
                                          for i in range(n)]
    chunk = text.get("attention_chunk_size")
    types = text.get("layer_types") or [_CHUNKED if r and chunk is not None else _FULL
                                        for r in rope]
    return [bool(r) for r in rope], [t == _CHUNKED for t in types]


class _ThenQKNorm(nn.Module):
    """RoPE, then transformers' QK norm with its eps: mlx-lm's Attention norms what its
    ``rope`` returns, with eps 1e-6 (its ``use_qk_norm`` is then switched off)."""

    def __init__(self, rope, eps: float):
        super().__init__()
        self.rope, self.eps = rope, eps

    def __call__(self, x, offset: int = 0):
        return mx.fast.rms_norm(self.rope(x, offset=offset), None, self.eps)


def _chunk_mask(h, cache, size: int):
    """mlx-lm's llama4.py chunk mask for one layer's cache: a key is seen from the
    same chunk of ``size`` tokens, up to the query. A cache that is no ChunkedKVCache
    but makes its own mask (yeto's document `yeto.mlx.packing.MaskCache`) has it
    applied too, and its chunks counted from each query's document start (its first
    visible key), as transformers counts them from each document's positions: a packed
    document is chunked as the document alone."""
    from mlx_lm.models.base import create_attention_mask

    if hasattr(cache, "maybe_trim_front"):
        cache.maybe_trim_front()
    start = getattr(cache, "start_position", 0)
    offset = getattr(cache, "offset", 0)
    end = offset + h.shape[1]
    keys, queries = mx.arange(start, end), mx.arange(offset, end)[:, None]
    own = (create_attention_mask(h, cache, return_array=True)
           if cache is not None and not hasattr(cache, "start_position") else None)
    if own is None:
        return ((keys // size) == (queries // size)) & (keys <= queries)
    first = keys[mx.argmax(own.astype(mx.int32), axis=-1)][..., None] if own.ndim >= 2 else 0
    return (((keys - first) // size) == ((queries - first) // size)) & (keys <= queries) & own


def _call(self, inputs, cache=None):
    """llama4.py's LlamaModel.__call__ with each layer's mask from its own kind and cache."""
    from mlx_lm.models.base import create_attention_mask

    h = self.embed_tokens(inputs)
    for layer, c in zip(self.layers, cache or [None] * len(self.layers)):
        mask = (_chunk_mask(h, c, self.attention_chunk_size) if layer.yeto_chunked
                else create_attention_mask(h, c))
        h = layer(h, mask, cache=c)
    return self.norm(h)


def _make_cache(self):
    from mlx_lm.models.cache import ChunkedKVCache, KVCache

    size = self.args.text_config.attention_chunk_size
    return [ChunkedKVCache(size) if layer.yeto_chunked else KVCache() for layer in self.layers]


def _swap(module, **methods) -> None:
    cls = type(module)
    module.__class__ = type(cls.__name__, (cls,), {**methods, "__module__": cls.__module__})


def follow_config(model, config: dict[str, Any]) -> list[str]:
    """Make a built llama4.py model follow the config's plan (module docstring);
    returns what was done (nothing for other model types)."""
    wanted = plan(config)
    if wanted is None:
        return []
    rotates, chunked = wanted
    inner = next((m for _, m in model.named_modules()
                  if hasattr(m, "attention_chunk_size") and isinstance(m.get("layers"), list)),
                 None)
    if inner is None or len(inner["layers"]) != len(rotates) or len(chunked) != len(rotates):
        raise UnsupportedConfig(
            f"no_rope_layers / layer_types for {len(rotates)} layers: mlx-lm's llama4.py built "
            "no decoder layer list of that length to follow them (set num_hidden_layers to "
            "the lists' length)")
    for layer, rope, chunk in zip(inner["layers"], rotates, chunked):
        layer.self_attn = type(layer.self_attn)(layer.args, 0 if rope else 3)
        layer.yeto_chunked = chunk
        attn = layer.self_attn
        if attn.use_qk_norm:
            attn.rope, attn.use_qk_norm = _ThenQKNorm(attn.rope, layer.args.rms_norm_eps), False
    _swap(inner, __call__=_call)
    _swap(model, make_cache=_make_cache)
    return [f"llama4 plan: rope {''.join('r' if r else '.' for r in rotates)}, "
            f"chunked {''.join('c' if c else '.' for c in chunked)}"]
