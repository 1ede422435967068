"""The activation the config names, computed exactly on the MLX island.

transformers builds each MLP's activation from the config (``ACT2FN[config.hidden_act]``);
mlx-lm's model files call one activation hard-coded (``nn.gelu(...)`` in gemma.py,
``nn.gelu_approx(...)`` in gpt_neox.py, ``swiglu(gate, x)`` in llama.py). Where the two
differ (gemma, gpt_bigcode and starcoder2 checkpoints say the tanh GELU, mlx-lm computes
the exact one; gpt_neox the other way round), the MLX model computes another function
than the torch island from the same weights, off by up to ~5e-4 per activation.

`patch_activations` makes them agree, generally: `ACTIVATION_SITES` names, per model
type, the config field transformers reads and the mlx-lm classes whose hard-coded
call stands for it; `ACTIVATIONS` maps every transformers activation name to the MLX
function that computes it exactly. For each such module of the built model whose
call differs from the config's, the module gets a subclass whose ``__call__`` is the
same code with the called name bound to the config's function (``swiglu(gate, x)``
becomes ``act(gate) * x``). Nothing else of the module changes (parameters, paths,
type name). A config naming an activation no MLX function computes is refused with
the field and the value.
"""

from __future__ import annotations

import types
from typing import Any

from yeto.mlx.errors import UnsupportedConfig
from yeto.mlx.rebind import Namespace, call_code, with_globals

#: transformers activation name (``transformers.activations.ACT2CLS``) -> the MLX
#: function computing exactly the same formula (`_function` resolves the name)
ACTIVATIONS: dict[str, str] = {
    "gelu": "gelu", "gelu_python": "gelu",                      # 0.5 x (1 + erf(x / sqrt 2))
    "gelu_pytorch_tanh": "gelu_approx", "gelu_python_tanh": "gelu_approx",
    "gelu_new": "gelu_approx", "gelu_fast": "gelu_approx",      # 0.5 x (1 + tanh(sqrt(2/pi)
    "gelu_accurate": "gelu_approx",                             #   (x + 0.044715 x^3)))
    "quick_gelu": "gelu_fast_approx",                           # x sigmoid(1.702 x)
    "gelu_10": "gelu_10",                                       # clip(gelu(x), -10, 10)
    "silu": "silu", "swish": "silu", "relu": "relu", "relu2": "relu2", "relu6": "relu6",
    "leaky_relu": "leaky_relu", "mish": "mish", "sigmoid": "sigmoid", "tanh": "tanh",
    "linear": "identity",
}

#: the activations mlx-lm's model files call, as the `ACTIVATIONS` value they compute
#: (``swiglu(gate, x)`` is ``silu(gate) * x``: a gated call, see `_bind`)
CALLED: dict[str, str] = {
    "gelu": "gelu", "gelu_approx": "gelu_approx", "gelu_fast_approx": "gelu_fast_approx",
    "silu": "silu", "swiglu": "silu", "relu": "relu", "relu2": "relu2",
    "relu_squared": "relu2",
}
_GATED = {"swiglu"}

_MLP = ("hidden_act", ("MLP",))
_ACT = "hidden_activation"
#: model type -> (config field transformers builds the activation from, the mlx-lm
#: classes whose one hard-coded activation call stands for it). Each class's
#: ``__call__`` calls exactly one of `CALLED` (tests/unit/test_arch_parity.py checks);
#: the field is read from ``text_config`` when the config nests one.
ACTIVATION_SITES: dict[str, tuple[str, tuple[str, ...]]] = {
    # GELU: the tanh form and the exact one (the variants the presets differ on)
    "gemma": _MLP, "gpt_neox": _MLP, "starcoder2": _MLP,
    "gpt_bigcode": ("activation_function", ("MLP",)),
    "gpt2": ("activation_function", ("MLP",)), "gptj": ("activation_function", ("GPTJMLP",)),
    "phi": ("hidden_act", ("PhiMLP",)),
    "gemma2": (_ACT, ("MLP",)), "gemma3": (_ACT, ("MLP",)), "gemma3_text": (_ACT, ("MLP",)),
    "recurrent_gemma": (_ACT, ("MLPBlock", "RecurrentBlock")),
    # squared ReLU
    "bitnet": _MLP, "nanochat": _MLP, "nemotron": _MLP,
    "nemotron_h": ("mlp_hidden_act", ("NemotronHMLP",)),
    # gated MLPs: down(act(gate(x)) * up(x)), mlx-lm's swiglu
    **dict.fromkeys(
        ("afmoe", "bailing_hybrid", "cohere", "cohere2", "ernie4_5", "exaone", "exaone4",
         "exaone_moe", "glm4_moe", "granite", "hunyuan_v1_dense", "internlm3", "laguna",
         "llama", "llama4", "llama4_text", "mimo_v2_flash", "minicpm3", "ministral3",
         "olmo2", "olmo_hybrid", "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_5",
         "qwen3_moe", "seed_oss", "stablelm"), _MLP),
    "deepseek_v2": ("hidden_act", ("DeepseekV2MLP",)),
    "deepseek_v3": ("hidden_act", ("DeepseekV3MLP",)),
    "deepseek_v32": ("hidden_act", ("DeepseekV32MLP",)),
    "dots1": ("hidden_act", ("Dots1MLP",)), "ernie4_5_moe": ("hidden_act", ("Ernie4_5_MLP",)),
    "falcon_h1": ("hidden_act", ("FalconH1MLP",)), "glm": ("hidden_act", ("GLMMLP",)),
    "glm4": ("hidden_act", ("Glm4MLP",)), "glm4_moe_lite": ("hidden_act", ("Glm4MoeLiteMLP",)),
    "granitemoehybrid": ("hidden_act", ("GraniteMoeHybridSharedMLP", "GraniteMoeHybridMLP")),
    "helium": ("hidden_act", ("HeliumMLP",)), "jamba": ("hidden_act", ("JambaMLP",)),
    "kimi_linear": ("hidden_act", ("KimiMLP",)),
    "longcat_flash": ("hidden_act", ("LongcatFlashMLP",)),
    "olmo3": ("hidden_act", ("Olmo3MLP",)), "qwen3_next": ("hidden_act", ("Qwen3NextMLP",)),
}


class ActivationError(UnsupportedConfig):
    """A config names an activation no MLX function computes."""


def _function(name: str):
    """The MLX function of an `ACTIVATIONS` value."""
    import mlx.core as mx
    import mlx.nn as nn

    special = {"identity": lambda x: x, "sigmoid": mx.sigmoid, "tanh": mx.tanh,
               "gelu_10": lambda x: mx.clip(nn.gelu(x), -10.0, 10.0)}
    return special[name] if name in special else getattr(nn, name)


def config_activation(config: dict[str, Any], field: str) -> str | None:
    """The activation the config names in ``field`` (in ``text_config`` too)."""
    for level in (config, config.get("text_config")):
        if isinstance(level, dict) and isinstance(level.get(field), str):
            return level[field]
    return None


def wanted(model_type: str, config: dict[str, Any]) -> str | None:
    """The `ACTIVATIONS` value the config asks for at this model type's sites (None:
    no site, or the config names none). Raises `ActivationError` for a name that no
    MLX function computes."""
    site = ACTIVATION_SITES.get(model_type)
    if site is None:
        return None
    name = config_activation(config, site[0])
    if name is None:
        return None
    if name not in ACTIVATIONS:
        raise ActivationError(
            f"{site[0]}={name!r}: no MLX function computes transformers' {name!r} "
            f"activation; the MLX island knows {', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name]


def called(cls) -> str | None:
    """The one `CALLED` activation a module class's ``__call__`` calls (None: none, or
    more than one)."""
    code = call_code(cls)
    found = set(code.co_names) & set(CALLED) if code is not None else set()
    return found.pop() if len(found) == 1 else None


def _bind(cls, name: str, target: str) -> type:
    """A subclass of ``cls`` whose ``__call__`` is its own code with the activation
    ``name`` bound to the MLX function ``target`` (a gated ``swiglu(gate, x)`` to
    ``target(gate) * x``)."""
    fn = _function(target)
    new = (lambda gate, x: fn(gate) * x) if name in _GATED else fn
    owner = next(c for c in cls.__mro__ if "__call__" in vars(c))
    scope = vars(owner)["__call__"].__globals__
    if name in scope and not isinstance(scope[name], types.ModuleType):
        replaced = {name: new}                 # swiglu(...), relu_squared(...)
    else:                                      # nn.gelu(...): the module it is read from
        replaced = {ref: Namespace(scope[ref], {name: new}) for ref in call_code(cls).co_names
                    if isinstance(scope.get(ref), types.ModuleType) and hasattr(scope[ref], name)}
    return with_globals(cls, replaced, key=("activation", name, target))


def patch_activations(model, model_type: str, config: dict[str, Any]) -> list[str]:
    """Bind the config's activation into the modules of `ACTIVATION_SITES` whose
    hard-coded call computes another one; returns ``"Class: called -> target"`` once
    per patched class (empty when nothing differs)."""
    target = wanted(model_type, config)
    if target is None:
        return []
    classes = ACTIVATION_SITES[model_type][1]
    done: dict[str, str] = {}
    for _, module in model.named_modules():
        cls = type(module)
        if cls.__name__ not in classes or vars(cls).get("_yeto_rebound"):
            continue
        name = called(cls)
        if name is None or CALLED[name] == target:
            continue
        module.__class__ = _bind(cls, name, target)
        done[cls.__name__] = f"{cls.__name__}: {name} -> {target}"
    return list(done.values())
