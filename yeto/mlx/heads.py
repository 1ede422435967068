"""Attention heads as wide as the config's ``head_dim``, whatever mlx-lm builds.

transformers builds every attention with the config's ``head_dim``: q is
``num_attention_heads x head_dim`` wide, k and v ``num_key_value_heads x head_dim``,
the softmax scale is ``head_dim ** -0.5``, RoPE rotates ``head_dim x
partial_rotary_factor`` dims, and the output is ``heads x head_dim`` wide before
``o_proj``, the config object's ``head_dim`` (`transformers_head_dim` puts it in the
config where config.json lacks it). That need not be ``hidden_size``. Some mlx-lm 0.32
files cannot hold it:

- internlm3.py, mixtral.py, recurrent_gemma.py: their ``ModelArgs`` have no
  ``head_dim``; the attention is ``hidden_size // num_attention_heads`` per head;
- cohere2.py reads ``head_dim`` but raises unless heads x head_dim = hidden_size
  (`build` builds it at hidden_size // heads first, `_NARROW_FIRST`);
- exaone.py reads ``head_dim`` but reshapes the attention output to the input's width;
  recurrent_gemma.py reshapes keys and values to one head whatever
  ``num_key_value_heads`` says (`_OWN_CALL`).

`fit_heads` gives each such attention of the built model (a module with an int
``head_dim`` and q/k/v/o ``nn.Linear`` projections) the config's widths before the
weights load: new projections (same biases), ``head_dim``, ``scale``, and a plain
``nn.RoPE`` over the same share of the head (the config's ``partial_rotary_factor``
where it says one) with the same base and layout, which `yeto.mlx.rope.fix_rope` then
scales as the config says; an attention of a file in `_OWN_CALL` whose own call cannot
compute the config's widths gets `_attention`, the same steps reshaped as transformers
reshapes them (heads of ``head_dim``, as many as the projections hold). What it cannot
widen (fused projections, a scale not ``head_dim ** -0.5``, other parameters as wide as
a head, a file's own RoPE class without scaling, key/value heads a file's call
hard-codes) is refused with `UnsupportedConfig`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import mlx.nn as nn

from yeto.mlx.errors import UnsupportedConfig, mlx_file

# mlx-lm files that raise unless num_attention_heads x head_dim = hidden_size
_NARROW_FIRST = {"cohere2"}
# mlx-lm files whose attention ``__call__`` hard-codes a width; where the config asks for
# another, the attention computes as transformers' does instead (`_attention`)
_OWN_CALL = {"exaone": "reshapes the output to the input's width (hidden_size)",
             "recurrent_gemma": "reshapes keys and values to one head"}
_OUT_NAMES = ("o_proj", "out_proj")


def shape(config: dict[str, Any]) -> tuple[int, int, int, int] | None:
    """(head_dim, hidden_size, num_attention_heads, num_key_value_heads) transformers
    builds the attention with; None where another rule decides (a composite's text model,
    DeepSeek's latent attention) or the config has no such fields."""
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if ("text_config" in config or "kv_lora_rank" in config
            or not all(isinstance(x, int) and x > 0 for x in (hidden, heads))):
        return None
    hd, kv = config.get("head_dim"), config.get("num_key_value_heads")
    hd = hd if isinstance(hd, int) and hd > 0 else hidden // heads
    kv = kv if isinstance(kv, int) and kv > 0 else heads
    return hd, hidden, heads, kv


def transformers_head_dim(config: dict[str, Any], hf) -> int | None:
    """The head_dim transformers' model is built with (its config object's), where
    ``config`` says another or none: a config.json without the field (written by code
    that did not have it) gets the class default (InternLM3Config: 128, whatever
    hidden_size // num_attention_heads is). None where they agree."""
    try:
        value = getattr(hf, "head_dim", None) if hf is not None else None
    except Exception:  # noqa: BLE001 - an attribute transformers refuses to read
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value != config.get(
            "head_dim"):
        return value
    return None


def build(model_cls, args, config: dict[str, Any]):
    """``model_cls(args)``; a file in `_NARROW_FIRST` is built with head_dim =
    hidden_size // heads (so are layers rebuilt from the model's arguments before
    `fit_heads` widens them and gives the arguments the config's head_dim back)."""
    s = shape(config)
    if config.get("model_type") not in _NARROW_FIRST or s is None or s[0] * s[2] == s[1]:
        return model_cls(args)
    hd, hidden, heads, _ = s
    if hidden % heads:
        raise UnsupportedConfig(
            f"head_dim={hd}: {mlx_file(model_cls)} builds its attention only where "
            f"num_attention_heads x head_dim = hidden_size, and hidden_size={hidden} is not "
            f"a multiple of num_attention_heads={heads} to build it narrower first")
    args.head_dim = hidden // heads  # the config's again once `fit_heads` has widened
    return model_cls(args)


def _reads_head_dim(args) -> bool:
    if dataclasses.is_dataclass(args):
        return "head_dim" in {f.name for f in dataclasses.fields(args)}
    return hasattr(args, "head_dim")


def fit_heads(model, args, config: dict[str, Any]) -> list[str]:
    """Give the attentions of the built ``model`` the config's head_dim and key/value
    heads (see the module docstring); returns the paths of the modules changed."""
    s, kind = shape(config), config.get("model_type")
    if s is None or (s[0] * s[2] == s[1] and kind not in _OWN_CALL):
        return []
    hd, hidden, heads, kv = s
    reads = _reads_head_dim(args)
    narrow = hidden // heads if (not reads or kind in _NARROW_FIRST) else None
    done, fitted = [], False
    for path, m in model.named_modules():
        if not isinstance(getattr(m, "head_dim", None), int) or "q_proj" not in m:
            continue
        if m.head_dim == narrow != hd:
            _widen(m, hd, heads, kv, config, args, free_kv=kind in _OWN_CALL)
            done.append(path)
        if kind in _OWN_CALL and m.head_dim == hd and _own_call_needed(m, s):
            _project(m, hd, heads, kv)
            m.__class__ = _with_attention(type(m))
            done.append(f"{path} (transformers' reshapes: {heads}/{kv} heads x {hd})")
        fitted = fitted or m.head_dim == hd
    if kind in _NARROW_FIRST:
        _restore(model, args, hd, hidden // heads)
    if not reads and not fitted and hd * heads != hidden:
        raise UnsupportedConfig(
            f"head_dim={hd}: {mlx_file(model)} builds its attention {hidden // heads} wide per "
            f"head (hidden_size // num_attention_heads = {hidden} // {heads}) in a form yeto "
            "cannot widen (it widens q_proj, k_proj, v_proj and o_proj linears)")
    return done


def _own_call_needed(attn, s: tuple[int, int, int, int]) -> bool:
    """Whether the config asks ``attn`` (of a file in `_OWN_CALL`) for a width its own
    ``__call__`` cannot compute: heads not hidden_size wide together, or other key/value
    heads than its projections hold."""
    hd, hidden, heads, kv = s
    return hd * heads != hidden or attn.k_proj.weight.shape[0] != kv * hd


def _restore(model, args, hd: int, narrow: int) -> None:
    """The config's head_dim back in the arguments `build` narrowed (and the copies
    layers were rebuilt from)."""
    held = [args] + [vars(m).get("args") for _, m in model.named_modules()]
    for a in held:
        if dataclasses.is_dataclass(a) and getattr(a, "head_dim", None) == narrow:
            a.head_dim = hd


def _linear(m, name: str, where: str) -> nn.Linear:
    layer = m.get(name) if isinstance(m, dict) else None
    if type(layer) is not nn.Linear:
        raise UnsupportedConfig(f"head_dim: {where}'s {type(m).__name__}.{name} is "
                                f"{type(layer).__name__}, not a linear yeto can widen")
    return layer


def _project(attn, hd: int, heads: int, kv: int) -> None:
    """``attn``'s q/k/v/o projections for ``heads`` queries and ``kv`` key/value heads
    ``hd`` wide (same input and output widths, same biases); those already that wide
    are kept."""
    where = mlx_file(type(attn))
    out_name = next((n for n in _OUT_NAMES if n in attn), _OUT_NAMES[0])
    q, k, v, o = (_linear(attn, n, where) for n in ("q_proj", "k_proj", "v_proj", out_name))
    hidden = q.weight.shape[1]
    for name, old, shape_ in (("q_proj", q, (heads * hd, hidden)),
                              ("k_proj", k, (kv * hd, hidden)), ("v_proj", v, (kv * hd, hidden)),
                              (out_name, o, (o.weight.shape[0], heads * hd))):
        if old.weight.shape != shape_:
            setattr(attn, name, nn.Linear(shape_[1], shape_[0], bias="bias" in old))


def _widen(attn, hd: int, heads: int, kv: int, config: dict[str, Any], args,
           free_kv: bool) -> None:
    """``attn``'s projections, head_dim, scale and RoPE at head width ``hd``; its
    key/value heads stay as built unless ``free_kv`` (its call reshapes them as the
    config says)."""
    old, where, name = attn.head_dim, mlx_file(type(attn)), type(attn).__name__
    out_name = next((n for n in _OUT_NAMES if n in attn), _OUT_NAMES[0])
    built_q = _linear(attn, "q_proj", where).weight.shape[0]
    built_kv = _linear(attn, "k_proj", where).weight.shape[0] // old
    if built_q != heads * old:
        raise UnsupportedConfig(f"head_dim={hd}: {where}'s {name}.q_proj is {built_q} wide, "
                                f"not num_attention_heads x {old}; yeto cannot widen it")
    if built_kv != kv and not free_kv:
        raise UnsupportedConfig(f"num_key_value_heads={kv}: {where} builds {built_kv} "
                                f"key/value head(s) in {name}")
    if not math.isclose(getattr(attn, "scale", old ** -0.5), old ** -0.5):
        raise UnsupportedConfig(f"head_dim={hd}: {where}'s {name} scales its softmax by "
                                f"{attn.scale}, not head_dim ** -0.5; yeto cannot tell the "
                                "scale at another width")
    for child_name, child in attn.children().items():
        if child_name not in ("q_proj", "k_proj", "v_proj", out_name, "rope") and any(
                old in p.shape for _, p in _flat(child)):
            raise UnsupportedConfig(f"head_dim={hd}: {where}'s {name}.{child_name} is as "
                                    "wide as a head; yeto widens only the projections")
    _project(attn, hd, heads, kv if free_kv else built_kv)
    attn.head_dim, attn.scale = hd, hd ** -0.5
    if "rope" in attn:
        attn.rope = _rope(attn.rope, old, hd, config, args, where)


def _flat(module) -> list:
    from mlx.utils import tree_flatten

    return tree_flatten(module.parameters()) if isinstance(module, nn.Module) else []


def _partial_factor(config: dict[str, Any]) -> float | None:
    rope = config.get("rope_parameters")
    for level in (config, rope if isinstance(rope, dict) else {}):
        if isinstance(level.get("partial_rotary_factor"), (int, float)):
            return float(level["partial_rotary_factor"])
    return None


def _rope(old, old_hd: int, hd: int, config: dict[str, Any], args, where: str) -> nn.RoPE:
    """A plain nn.RoPE for heads ``hd`` wide where ``old`` rotated heads ``old_hd`` wide:
    the config's share of the head (else ``old``'s), ``old``'s base and layout; a scaling
    the config asks for is `yeto.mlx.rope.fix_rope`'s to apply."""
    dims = getattr(old, "dims", getattr(old, "dim", None))
    scaled = isinstance(config.get("rope_scaling"), dict)
    if not isinstance(dims, int) or (type(old) is not nn.RoPE and not scaled):
        raise UnsupportedConfig(f"head_dim={hd}: {where} rotates with its own "
                                f"{type(old).__name__}, which yeto cannot widen")
    factor = _partial_factor(config) or dims / old_hd
    base = old.base if type(old) is nn.RoPE else getattr(args, "rope_theta", 10000.0)
    scale = old.scale if type(old) is nn.RoPE and not scaled else 1.0
    return nn.RoPE(int(hd * factor), traditional=getattr(old, "traditional", False),
                   base=base, scale=scale)


_OWN: dict[type, type] = {}


def _with_attention(cls: type) -> type:
    """``cls`` (an attention of a file in `_OWN_CALL`) with `_attention` as its
    ``__call__``."""
    if getattr(cls, "_yeto_heads", False):
        return cls
    if cls not in _OWN:
        _OWN[cls] = type(cls.__name__, (cls,), {
            "__call__": _attention, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__, "_yeto_heads": True})
    return _OWN[cls]


def _attention(self, x, mask=None, cache=None):
    """The attention of mlx_lm/models/exaone.py's ``AttentionModule`` and
    recurrent_gemma.py's ``LocalAttentionBlock`` (same steps: project, rotate, attend
    with ``self.scale``, project out), reshaped as transformers' attention is: heads of
    ``head_dim`` as many as the projections hold (``-1``), the output heads x head_dim
    wide. Called by keyword (recurrent_gemma.py) or by position (exaone.py)."""
    from mlx_lm.models.base import scaled_dot_product_attention

    B, L, _ = x.shape
    q, k, v = (p(x).reshape(B, L, -1, self.head_dim).transpose(0, 2, 1, 3)
               for p in (self.q_proj, self.k_proj, self.v_proj))
    if cache is not None:
        q = self.rope(q, offset=cache.offset)
        k = self.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
    else:
        q, k = self.rope(q), self.rope(k)
    out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
    out_proj = self["o_proj"] if "o_proj" in self else self["out_proj"]
    return out_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
