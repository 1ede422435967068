"""RoPE on the MLX island as transformers computes it for the config's ``rope_type``.

Many mlx-lm model files build a plain ``nn.RoPE`` whatever the config's scaling says
(gemma.py, glm.py, ernie4_5.py, ...), and mlx-lm's longrope (``SuScaledRoPE``) always
rotates with ``long_factor``, where transformers uses ``short_factor`` while the
positions fit in ``original_max_position_embeddings``. `fix_rope` replaces, in the
built model, each such module by the one the config means: mlx-lm's own
``initialize_rope`` for linear, dynamic, llama3 and yarn (same dims, base and layout
as the module it replaces), and `LongRoPE` for longrope (`exact_rope`). A model
file's own rotary class or function (DeepSeek-V2's yarn-only class, hunyuan's
NTK-alpha, nanochat's function) is replaced the same way where it does not apply the
config's type, and a model whose constructor refused the scaling was built without
it (`yeto.mlx.rope_files`); its rotaries are replaced here.
"""

from __future__ import annotations

import json
import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from yeto.mlx import rope_files
from yeto.mlx.errors import UnsupportedConfig


class LongRoPE(nn.Module):
    """transformers' longrope: inverse frequencies ``1 / (ext · base^(2i/d))`` with
    ext = ``short_factor`` while offset + length <= ``original_max_position_embeddings``,
    else ``long_factor``; the rotated part scaled by the attention factor (``factor``,
    else max / original positions)."""

    def __init__(self, dims: int, base: float, scaling: dict[str, Any],
                 max_position_embeddings: int | None, traditional: bool = False):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self.original = int(scaling["original_max_position_embeddings"])
        factor = scaling.get("factor") or (max_position_embeddings or self.original) / self.original
        scale = scaling.get("attention_factor")
        if scale is None:
            scale = (1.0 if factor <= 1.0
                     else math.sqrt(1 + math.log(factor) / math.log(self.original)))
        self.scale = float(scale)
        periods = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
        self._short = mx.array(scaling["short_factor"], dtype=mx.float32) * periods
        self._long = mx.array(scaling["long_factor"], dtype=mx.float32) * periods

    def __call__(self, x, offset=0):
        end = (offset if isinstance(offset, int) else int(mx.max(offset).item())) + x.shape[-2]
        freqs = self._short if end <= self.original else self._long
        return mx.fast.rope(x.at[..., :self.dims].multiply(self.scale), self.dims,
                            traditional=self.traditional, base=None, scale=1.0, offset=offset,
                            freqs=freqs)


def _scaling(config: dict[str, Any]) -> dict[str, Any] | None:
    for level in (config.get("text_config"), config):
        if isinstance(level, dict) and isinstance(level.get("rope_scaling"), dict):
            kind = level["rope_scaling"].get("rope_type", level["rope_scaling"].get("type"))
            return None if kind in (None, "default") else level["rope_scaling"]
    return None


_MAX_POSITIONS = ("max_position_embeddings", "max_seq_len", "n_positions", "n_ctx")


def _max_positions(config: dict[str, Any]) -> int | None:
    for level in (config.get("text_config"), config):
        for key in _MAX_POSITIONS:
            if isinstance(level, dict) and level.get(key):
                return int(level[key])
    return None


def _theta(config: dict[str, Any]) -> float:
    for level in (config.get("text_config"), config):
        if isinstance(level, dict) and level.get("rope_theta"):
            return float(level["rope_theta"])
    return 10000.0


def exact_rope(dims: int, base: float, traditional: bool, scaling: dict,
               max_positions: int | None) -> nn.Module:
    """transformers' rotary for ``scaling``'s rope_type over ``dims`` features: plain
    ``nn.RoPE`` for default, mlx-lm's own for linear, dynamic, llama3 and yarn (yarn
    untruncated where the config says so), `LongRoPE` for longrope."""
    from mlx_lm.models.rope_utils import initialize_rope

    kind = _kind(scaling)
    if kind == "default":
        return nn.RoPE(dims, traditional=traditional, base=base)
    if kind == "longrope":
        return LongRoPE(dims, base, scaling, max_positions, traditional)
    if kind not in ("linear", "dynamic", "llama3", "yarn"):
        raise UnsupportedConfig(f"rope_parameters.rope_type={kind!r}: yeto's MLX island "
                                "cannot rotate with that type")
    if kind == "dynamic" and max_positions is None:
        raise UnsupportedConfig("rope_parameters.rope_type='dynamic' needs "
                                "max_position_embeddings in the config: set it")
    rope = initialize_rope(dims, base, traditional, scaling, max_positions)
    if kind == "yarn":
        rope.mscale = _yarn_attention_factor(scaling)
        if scaling.get("truncate") is False:
            _untruncate(rope, scaling, base)
    return rope


def _yarn_attention_factor(scaling: dict) -> float:
    """transformers' yarn attention factor: ``attention_factor``, else mscale(factor,
    mscale) / mscale(factor, mscale_all_dim) where both are given, else mscale(factor)
    (mlx-lm's YarnRoPE takes the ratio with defaults 1 and 0 whatever is given)."""
    factor = float(scaling["factor"])

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"])
    return mscale()


def _kind(scaling: dict) -> str:
    return scaling.get("rope_type", scaling.get("type"))


def _replacement(old, scaling: dict, config: dict, args=None):
    """The module ``old`` should be for this scaling, or None to keep it."""
    from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE, YarnRoPE

    kind = _kind(scaling)
    max_pos = _max_positions(config)
    if isinstance(old, DynamicNTKScalingRoPE) and old.max_position_embeddings is None:
        # built without the positions (gpt_oss.py): it would fail at the first call
        return exact_rope(old.dims, old.base, old.traditional, scaling, max_pos)
    if isinstance(old, YarnRoPE) and kind == "yarn" and scaling.get("truncate") is False \
            and not getattr(old, "_untruncated", False):
        _untruncate(old, scaling, _theta(config))
        return None
    own = rope_files.describe(old, args, kind, scaling)
    if own is not None:
        return None if kind in own.applies else exact_rope(
            own.dims, _theta(config), own.traditional, scaling, max_pos)
    if type(old) is not nn.RoPE:
        return None
    if kind == "linear" and not math.isclose(old.scale, 1.0):
        return None  # the model file applied the linear factor itself
    return exact_rope(old.dims, old.base, old.traditional, scaling, max_pos)


def _untruncate(rope, scaling: dict, base: float) -> None:
    """mlx-lm's YarnRoPE rounds the correction range to whole dimensions (floor, ceil),
    which transformers does only while ``truncate`` is true (gpt-oss says false): its
    frequencies recomputed from the exact range."""
    dims, factor = rope.dims, float(scaling["factor"])
    orig = scaling.get("original_max_position_embeddings") or 4096

    def dim_of(rotations: float) -> float:
        return dims * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(dim_of(scaling.get("beta_fast") or 32), 0)
    high = min(dim_of(scaling.get("beta_slow") or 1), dims - 1)
    high = high + 0.001 if low == high else high
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    extra = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    inter = factor * extra
    keep = 1.0 - ramp
    rope._freqs = (inter * extra) / (inter * keep + extra * (1 - keep))
    rope._untruncated = True


def _expected(kind: str) -> tuple[str, ...]:
    """Class names a RoPE module may have for a scaling type (mlx-lm's and ours)."""
    return {"linear": ("RoPE",), "dynamic": ("DynamicNTKScalingRoPE",),
            "llama3": ("Llama3RoPE",), "longrope": ("LongRoPE",)}.get(kind, (kind,))


def fix_rope(model, args, config: dict[str, Any]) -> list[str]:
    """Replace the RoPE modules that ignore the config's scaling (see the module
    docstring) and rebind the rotary functions of `rope_files.OWN_FUNCTIONS`; returns
    the module paths replaced. A RoPE module of a class that does not apply the
    scaling and cannot be replaced, or a model built with the scaling hidden
    (`rope_files.NEUTRAL`) where nothing was replaced, is refused (`UnsupportedConfig`)."""
    scaling = _scaling(config)
    if scaling is None and getattr(args, rope_files.HIDDEN, False):
        scaling = {"rope_type": "default"}  # the file's own rotaries, built neutral: plain
    if scaling is None:
        return []
    kind = _kind(scaling)
    done = []
    for path, module in model.named_modules():
        for name, child in list(module.children().items()):
            if isinstance(child, nn.Module):
                done += _fix_child(module, path, name, child, scaling, config, args)
    theta, max_pos = _theta(config), _max_positions(config)
    done += rope_files.rebind_functions(
        model, lambda dims, trad: exact_rope(dims, theta, trad, scaling, max_pos),
        key=(json.dumps(scaling, sort_keys=True, default=str), theta, max_pos))
    if not done and getattr(args, rope_files.HIDDEN, False):
        raise UnsupportedConfig(
            f"rope_parameters.rope_type={kind!r}: mlx-lm's "
            f"{type(model).__module__.rsplit('.', 1)[-1]}.py cannot build that RoPE, and "
            "yeto found no rotary in the built model to replace")
    return done


def _fix_child(parent, path: str, name: str, child, scaling: dict, config: dict,
               args) -> list[str]:
    kind = _kind(scaling)
    new = _replacement(child, scaling, config, args)
    if new is not None:
        setattr(parent, name, new)
        rope_files.mla_softmax_scale(parent, scaling)
        return [f"{path}.{name}" if path else name]
    own = rope_files.describe(child, args, kind, scaling)
    if _is_rope(child) and (own is None or kind not in own.applies) and not any(
            e.lower() in type(child).__name__.lower() for e in _expected(kind)):
        raise UnsupportedConfig(
            f"rope_parameters.rope_type={kind!r}: mlx-lm's "
            f"{type(child).__module__.rsplit('.', 1)[-1]}.py rotates with its own "
            f"{type(child).__name__}, which does not apply {kind} scaling")
    return []


def _is_rope(module) -> bool:
    name = type(module).__name__
    return "RoPE" in name or "Rotary" in name
