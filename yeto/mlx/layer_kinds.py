"""Layers of each kind in any order, where mlx-lm places the kinds by a period.

transformers lists each layer's kind (``layer_types``: full / sliding / linear
attention; ``mlp_layer_types``: dense / sparse), in any order, one kind only
included. Several mlx-lm model files derive the kinds from a period instead
(`PERIODS`: qwen3_next.py's ``full_attention_interval``, gemma3_text.py's and
cohere2.py's ``sliding_window_pattern``, the deepseek family's
``first_k_dense_replace`` + ``moe_layer_freq``). When no period in range gives the
list (yeto.mlx.config fits one first), `rebuild_layers` builds each decoder layer
again with arguments whose period makes *that* layer the listed kind (layer i is
global when the period is i + 1, sliding when it is i + 2), and repairs what the
model derived from the period:

- the layer indices a model keeps to pick a cache per kind (qwen3_next's ``fa_idx``,
  ``ssm_idx``) are recomputed from the rebuilt layers (and `repair_indices` sets one
  that points past the last layer, for a kind the config has none of, to 0);
- where the model's ``__call__`` hands each layer the sliding-window or the global
  mask by the period (gemma3_text.py, cohere2.py), each layer makes its own mask by its
  kind instead (`_own_mask`), from the same cache (a document mask included).
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: the config key yeto.mlx.config writes the wanted kinds under ({field: [kind per layer]})
KEY = "yeto_layer_kinds"

#: mlx-lm period field -> the arguments that make layer i the kind (True: the kind the
#: period marks: global attention, full attention, sparse MLP)
PERIODS: dict[str, Any] = {
    "full_attention_interval": lambda i, marked: {"full_attention_interval": i + 1 if marked
                                                  else i + 2},
    "sliding_window_pattern": lambda i, marked: {"sliding_window_pattern": i + 1 if marked
                                                 else i + 2},
    "first_k_dense_replace": lambda i, marked: {"first_k_dense_replace": 0 if marked else i + 1,
                                                "moe_layer_freq": 1},
    "interleave_moe_layer_step": lambda i, marked: {"interleave_moe_layer_step": i + 1 if marked
                                                    else i + 2},
}


def _layer_list(model, n: int):
    """(owner module, its ``layers`` list) of the decoder layers (the deepest such list)."""
    found = [(p, m) for p, m in model.named_modules()
             if isinstance(m.get("layers") if isinstance(m, dict) else None, list)
             and len(m["layers"]) == n]
    return max(found, key=lambda pm: len(pm[0]))[1] if found else None


def _args_with(model, field: str):
    """The dataclass arguments the layers were built from (the one holding ``field``)."""
    for _, m in model.named_modules():
        for attr in ("args", "config"):
            a = vars(m).get(attr)
            if dataclasses.is_dataclass(a) and hasattr(a, field):
                return a
    return None


def _own_mask(layer, window: int | None, sliding: bool):
    """``layer`` makes its own mask: the sliding-window one or the causal one."""
    from mlx_lm.models.base import create_attention_mask

    cls = type(layer)
    call = cls.__call__

    def __call__(self, x, mask=None, cache=None, *args, **kwargs):
        mask = create_attention_mask(x, cache, window_size=window if sliding else None)
        return call(self, x, mask, cache, *args, **kwargs)

    layer.__class__ = type(cls.__name__, (cls,), {"__call__": __call__,
                                                 "__module__": cls.__module__})


#: ``*_idx`` attributes that bound a range of layers rather than pick one (gemma3n.py:
#: the layers from this one on share caches; the layer count when none does)
BOUNDS = {"first_kv_shared_layer_idx"}


def repair_indices(model) -> list[str]:
    """A layer index a model keeps to pick the cache of a kind (lfm2.py's ``conv_idx``,
    qwen3_next.py's ``fa_idx``) that points past the last layer, because the config has
    no layer of that kind, is set to 0: the mask made from it is handed to no layer. A
    bound past the last layer (`BOUNDS`) is set to the layer count: no layer is past it."""
    done = []
    for path, m in model.named_modules():
        layers = m.get("layers") if isinstance(m, dict) else None
        if not isinstance(layers, list):
            continue
        for attr, value in list(vars(m).items()):
            bound = attr in BOUNDS
            if attr.endswith("_idx") and isinstance(value, int) and value >= len(layers) + bound:
                setattr(m, attr, len(layers) if bound else 0)
                done.append(f"{path}.{attr}: {value} -> {getattr(m, attr)}")
    return done


def rebuild_layers(model, config: dict[str, Any]) -> list[str]:
    """Rebuild the decoder layers whose kinds `KEY` lists (module docstring); returns
    ``"field: kinds"`` per field rebuilt. Raises ValueError when the model's layers
    cannot be rebuilt that way (yeto.mlx.load reports it as unsupported)."""
    wanted = next((c[KEY] for c in (config, config.get("text_config"))
                   if isinstance(c, dict) and isinstance(c.get(KEY), dict)), None)
    done = []
    for field, marked in (wanted or {}).items():
        owner, args = _layer_list(model, len(marked)), _args_with(model, field)
        if owner is None or args is None:
            raise ValueError(f"no decoder layer list of {len(marked)} layers built from {field}")
        layers = owner["layers"]
        for i, is_marked in enumerate(marked):
            layer_args = dataclasses.replace(args, **PERIODS[field](i, is_marked))
            layers[i] = type(layers[i])(layer_args, i)
            if field == "sliding_window_pattern":
                _own_mask(layers[i], getattr(args, "sliding_window", None), not is_marked)
        for attr, linear in (("ssm_idx", True), ("fa_idx", False)):
            if attr in vars(owner) and all(hasattr(x, "is_linear") for x in layers):
                idx = next((j for j, x in enumerate(layers) if x.is_linear == linear), None)
                setattr(owner, attr, idx)
        done.append(f"{field}: {''.join('x' if m else '.' for m in marked)}")
    return done

