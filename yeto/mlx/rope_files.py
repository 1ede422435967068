"""The rotaries mlx-lm's model files define for themselves, and how yeto replaces them.

Most mlx-lm files rotate with ``nn.RoPE`` or a class of ``rope_utils`` (`yeto.mlx.rope`
replaces those by the config's RoPE type). A few bring their own:

- a class that applies one RoPE type only (`OWN_CLASSES`): deepseek_v2.py's
  ``DeepseekV2YarnRotaryEmbedding`` (yarn, interleaved pairs, the width of its input),
  hunyuan's ``DynamicNTKAlphaRoPE`` (NTK-alpha), minicpm3.py's ``SuScaledRoPE`` from
  rope_utils (longrope with ``long_factor`` at any length). `describe` says its width
  and layout, so that it can be replaced by transformers' rotary of another type;
- a function called inside attention (`OWN_FUNCTIONS`): nanochat.py's
  ``apply_rotary_emb``, which turns the other way (transformers' NanoChat rotates
  half with flipped signs). `rebind_functions` gives those attention classes a
  function that calls the replacement, `Reversed` where the file turns the other way;
- a constructor that refuses a RoPE type it would not apply anyway (qwen2_moe.py and
  nemotron.py: linear only; hunyuan_v1_dense.py: the NTK-alpha keys; gpt_oss.py calls
  ``initialize_rope`` without the positions longrope needs). `NEUTRAL` are the
  scalings such a model is built with instead; its rotaries are replaced afterwards.
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn

from yeto.mlx.rebind import call_code, with_globals

# what a model is built with when its constructor refuses the config's scaling: none,
# else a linear factor of 1 (the NTK alpha 1 too, for files that require that key)
NEUTRAL: tuple[dict | None, ...] = (
    None, {"type": "linear", "rope_type": "linear", "factor": 1.0, "alpha": 1.0})
HIDDEN = "_yeto_rope_hidden"  # set on ModelArgs built with a NEUTRAL scaling


def hidden_args(args_cls, params: dict):
    """``args_cls.from_dict(params)`` with the first `NEUTRAL` scaling it accepts, marked
    `HIDDEN`; None where there is no scaling to hide or it refuses them all (then the
    refusal was not the scaling's)."""
    if not isinstance(params.get("rope_scaling"), dict):
        return None
    for neutral in NEUTRAL:
        try:
            args = args_cls.from_dict({**params, "rope_scaling": neutral})
        except Exception:  # noqa: BLE001, S112 - the next neutral value, else the original error
            continue
        setattr(args, HIDDEN, True)
        return args
    return None


def hidden_build(model_cls, args):
    """``(model_cls(a), a)`` for ``a``, a copy of ``args`` with the first other `NEUTRAL`
    scaling the model builds with, marked `HIDDEN` (also for no scaling: deepseek_v2.py
    and minicpm3.py read keys of theirs); None as `hidden_args` says it."""
    if "rope_scaling" not in vars(args) or getattr(args, HIDDEN, False):
        return None
    for neutral in NEUTRAL:
        if neutral == args.rope_scaling:
            continue
        tried = copy.copy(args)
        tried.rope_scaling = neutral
        setattr(tried, HIDDEN, True)
        try:
            return model_cls(tried), tried
        except Exception:  # noqa: BLE001, S112 - the next neutral value, else the original error
            continue
    return None


LAYOUT = "_yeto_traditional"  # set on each rotary mlx-lm's initialize_rope returned


@contextmanager
def layouts_recorded():
    """While a model is built, each rotary mlx-lm's ``initialize_rope`` returns keeps the
    pair layout its caller asked for (`LAYOUT`): its longrope class, ``SuScaledRoPE``,
    drops ``traditional``, so an MLA file's interleaved pairs (deepseek_v3.py,
    longcat_flash.py: ``traditional=True``) would be rotated as halves. The model
    files' own references to the function are swapped for the recording one and put
    back after. Layers yeto builds again (`yeto.mlx.layer_kinds`,
    `yeto.mlx.models.llama4`) are built inside it too."""
    from mlx_lm.models import rope_utils

    original = rope_utils.initialize_rope

    def recording(dims, base, traditional, *args, **kwargs):
        rope = original(dims, base, traditional, *args, **kwargs)
        object.__setattr__(rope, LAYOUT, bool(traditional))
        return rope

    holders = [m for name, m in list(sys.modules.items()) if name.startswith("mlx_lm.models.")
               and getattr(m, "initialize_rope", None) is original]
    for m in holders:
        m.initialize_rope = recording
    try:
        yield
    finally:
        for m in holders:
            m.initialize_rope = original


@dataclass(frozen=True)
class Rotary:
    """What a rotary of a model file rotates: ``dims`` leading features of its input,
    in pairs of neighbours (``traditional``) or of halves; the RoPE types it applies as
    transformers does (any other is replaced)."""

    dims: int
    traditional: bool
    applies: tuple[str, ...] = ()


def _mla_dims(module, args) -> int:
    return int(args.qk_rope_head_dim)


OWN_CLASSES: dict[str, Callable[[Any, Any], Rotary]] = {
    # rotates its whole input, the MLA rope part (qk_rope_head_dim wide)
    "DeepseekV2YarnRotaryEmbedding": lambda m, a: Rotary(_mla_dims(m, a), True, ("yarn",)),
    # hunyuan: base x alpha^(d/(d-2)); transformers' "dynamic" with an alpha is that
    "DynamicNTKAlphaRoPE": lambda m, a: Rotary(m.dims, False),
    # longrope with long_factor at any length: yeto's LongRoPE replaces it even then
    "SuScaledRoPE": lambda m, a: Rotary(m.dim, getattr(m, LAYOUT, False)),
}


def describe(module, args, kind: str, scaling: dict) -> Rotary | None:
    """The rotary of a file's own class, or None for a class not in `OWN_CLASSES`."""
    make = OWN_CLASSES.get(type(module).__name__)
    if make is None:
        return None
    rotary = make(module, args)
    if type(module).__name__ == "DynamicNTKAlphaRoPE" and kind == "dynamic" \
            and scaling.get("alpha"):
        return Rotary(rotary.dims, rotary.traditional, ("dynamic",))
    return rotary


def mla_softmax_scale(attention, scaling: dict) -> None:
    """transformers' MLA attention (deepseek_v2, minicpm3) scales the softmax by
    ``q_head_dim^-0.5 x mscale^2`` with yarn's ``mscale(factor, mscale_all_dim)``, for any
    RoPE type but default; set so on an MLA attention whose rotary yeto replaced
    (minicpm3.py never applies it; a model built with the scaling hidden did not)."""
    name = next((n for n in ("softmax_scale", "scale")
                 if isinstance(getattr(attention, n, None), float)), None)
    if name is None or not isinstance(getattr(attention, "q_head_dim", None), int):
        return
    scale = attention.q_head_dim ** -0.5
    factor, all_dim = scaling.get("factor"), scaling.get("mscale_all_dim")
    if all_dim and factor and factor > 1:
        scale *= (0.1 * all_dim * math.log(factor) + 1.0) ** 2
    setattr(attention, name, scale)


class Reversed(nn.Module):
    """``rope`` turning the other way: rotating by -angle is rotating by +angle between
    two reflections that negate the second of each pair (exact: signs only)."""

    def __init__(self, rope: nn.Module, dims: int, traditional: bool = False):
        super().__init__()
        self.rope, self.dims, self.traditional = rope, dims, traditional

    def _reflect(self, x):
        if self.traditional:
            return x.at[..., 1:self.dims:2].multiply(-1.0)
        return x.at[..., self.dims // 2:self.dims].multiply(-1.0)

    def __call__(self, x, offset=0):
        return self._reflect(self.rope(self._reflect(x), offset=offset))


@dataclass(frozen=True)
class RotaryFunction:
    """A file's rotary function: its name, the attention attribute holding the width it
    rotates, and whether it turns the other way (negated frequencies)."""

    name: str
    width: str
    reversed: bool


OWN_FUNCTIONS = {
    # apply_rotary_emb(x, offset, base, freqs): head_dim wide, halves, negated frequencies
    "mlx_lm.models.nanochat": RotaryFunction("apply_rotary_emb", "head_dim", True),
}


def rebind_functions(model, make_rope: Callable[[int, bool], nn.Module], key: Any
                     ) -> list[str]:
    """Attention classes of ``model`` that call their file's rotary function (see
    `OWN_FUNCTIONS`) given one that rotates with ``make_rope(dims, traditional)``
    (``key``: what that rotary depends on, beside its width); returns the module paths."""
    done = []
    for path, module in model.named_modules():
        spec = OWN_FUNCTIONS.get(type(module).__module__)
        code = call_code(type(module))
        if spec is None or code is None or spec.name not in code.co_names:
            continue
        dims = int(getattr(module, spec.width))
        rope = make_rope(dims, False)
        if spec.reversed:
            rope = Reversed(rope, dims)

        def rotary(x, offset=0, base=None, freqs=None, rope=rope):
            return rope(x, offset=offset)

        module.__class__ = with_globals(type(module), {spec.name: rotary},
                                        key=("rotary", spec.name, dims, key))
        done.append(f"{path} ({spec.name})")
    return done

