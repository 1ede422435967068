"""RoPE on the MLX island as transformers computes it for the config's ``rope_type``.

Many mlx-lm model files build a plain ``nn.RoPE`` whatever the config's scaling says
(gemma.py, glm.py, ernie4_5.py, ...), and mlx-lm's longrope (``SuScaledRoPE``) always
rotates with ``long_factor``, where transformers uses ``short_factor`` while the
positions fit in ``original_max_position_embeddings``. `fix_rope` replaces, in the
built model, each such module by the one the config means: mlx-lm's own
``initialize_rope`` for linear, dynamic, llama3 and yarn (same dims, base and layout
as the module it replaces), and `LongRoPE` for longrope. Modules of other classes
(DeepSeek's MLA yarn, ...) are left to their model file.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn

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


def _replacement(old, scaling: dict, config: dict):
    """The module ``old`` should be for this scaling, or None to keep it."""
    from mlx_lm.models.rope_utils import SuScaledRoPE, YarnRoPE, initialize_rope

    kind = scaling.get("rope_type", scaling.get("type"))
    max_pos = _max_positions(config)
    if isinstance(old, YarnRoPE) and kind == "yarn" and scaling.get("truncate") is False \
            and not getattr(old, "_untruncated", False):
        _untruncate(old, scaling, _theta(config))
        return None
    if isinstance(old, SuScaledRoPE):
        return LongRoPE(old.dim, _theta(config), scaling, max_pos) if kind == "longrope" else None
    if type(old) is not nn.RoPE:
        return None
    if kind == "longrope":
        return LongRoPE(old.dims, old.base, scaling, max_pos, old.traditional)
    if kind == "linear" and not math.isclose(old.scale, 1.0):
        return None  # the model file applied the linear factor itself
    return initialize_rope(old.dims, old.base, old.traditional, scaling, max_pos)


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
    docstring); returns the module paths replaced. A RoPE module of the model file's
    own class that does not apply the scaling is refused (`UnsupportedConfig`)."""
    scaling = _scaling(config)
    if scaling is None:
        return []
    kind = scaling.get("rope_type", scaling.get("type"))
    done = []
    for path, module in model.named_modules():
        for name, child in list(module.children().items()):
            if not isinstance(child, nn.Module):
                continue
            new = _replacement(child, scaling, config)
            if new is not None:
                setattr(module, name, new)
                done.append(f"{path}.{name}" if path else name)
            elif _is_rope(child) and not any(
                    e.lower() in type(child).__name__.lower() for e in _expected(kind)):
                raise UnsupportedConfig(
                    f"rope_parameters.rope_type={kind!r}: mlx-lm's "
                    f"{type(child).__module__.rsplit('.', 1)[-1]}.py rotates with its own "
                    f"{type(child).__name__}, which does not apply {kind} scaling")
    return done


def _is_rope(module) -> bool:
    name = type(module).__name__
    return "RoPE" in name or "Rotary" in name
