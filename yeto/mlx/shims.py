"""Loading a Hugging Face model dir with mlx-lm, whatever transformers wrote it.

**Config translation.** mlx-lm 0.32 builds each model from a ``ModelArgs``
dataclass (``mlx_lm/models/<model_type>.py``) filled from ``config.json`` by field
name. transformers 5 writes many configs differently from the checkpoints those
files were written against, so before mlx-lm sees a config, `config_overrides`
fills every ``ModelArgs`` field the config holds under another form:

1. **The transformers config class itself** (the general mechanism). The dict is
   turned back into its transformers config object, and every ``ModelArgs`` field
   the dict lacks is read from it with ``getattr``: that covers the class's
   ``attribute_map`` aliases (qwen3_moe's ``num_experts`` -> ``num_local_experts``,
   exaone's ``num_layers``) and its derived attributes (properties, and values
   save_pretrained left out because they equal the class default).
2. **RoPE** (`flat_rope_overrides`). transformers >= 5 nests ``rope_theta`` and any
   scaling under ``"rope_parameters"``; most mlx-lm models read only the flat
   ``rope_theta`` / ``rope_scaling`` / ``partial_rotary_factor`` and silently fall
   back to their own defaults when those are missing (qwen2 1e6, llama 1e4), so the
   MLX model computes different logits than torch from the same weights.
   ``rope_scaling`` is ``None`` for plain RoPE (exaone4 requires the field).
3. **Defaults the modelling code applies** (``head_dim = hidden_size //
   num_attention_heads``) and the **few per-model keys** left (`_PER_MODEL`, each
   naming the mlx-lm file that reads it).

Composite configs (gemma3, llama4, qwen3_5: a ``text_config`` inside) get the same
translation of their ``text_config`` against mlx-lm's text-model arguments. A
value already in the config always wins.

One adapter, not a patch: mlx-lm models take no attention-mask argument (they
build a causal mask from the KV cache), so `document_cache` hands a block-diagonal
causal mask in through the cache protocol for document-packed blocks (see
yeto.data). Positions stay 0..T-1 through the block: RoPE makes q·k depend only
on the distance between tokens, and with the mask tokens only meet tokens of their
own document, so this equals restarting positions at every document start (as the
torch island does with ``position_ids``).
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("yeto.mlx.shims")

_MISSING = object()
# ModelArgs fields never read from the transformers object: RoPE is translated by
# flat_rope_overrides (transformers 5's ``rope_scaling`` attribute is an alias of
# ``rope_parameters`` with rope_theta inside, which mlx-lm takes for a scaling)
_NOT_FROM_OBJECT = {"rope_scaling", "rope_theta", "rope_parameters", "model_type",
                    "text_config", "vision_config", "audio_config", "quantization",
                    "quantization_config"}


def flat_rope_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """The flat RoPE keys mlx-lm reads, recovered from transformers-5
    ``rope_parameters`` (also inside ``text_config``). Empty when nothing is
    missing. Per-layer-type forms (``{"full_attention": {...}, ...}``) are left
    alone: the models that use them read ``rope_parameters`` themselves."""
    out: dict[str, Any] = {}
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        if config.get("rope_theta") is None:
            out["rope_theta"] = rope["rope_theta"]
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in (None, "default") and config.get("rope_scaling") is None:
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        if "partial_rotary_factor" in rope and config.get("partial_rotary_factor") is None:
            out["partial_rotary_factor"] = rope["partial_rotary_factor"]
    text = config.get("text_config")
    if isinstance(text, dict):
        inner = flat_rope_overrides(text)
        if inner:
            out["text_config"] = {**text, **inner}
    return out


def mlx_model_module(config: dict[str, Any]):
    """mlx-lm's model module for this config (its ``Model`` and ``ModelArgs``),
    chosen as mlx-lm chooses it (``mlx_lm.utils._get_classes``)."""
    from mlx_lm.utils import _get_classes

    return importlib.import_module(_get_classes(config)[0].__module__)


def args_fields(args_cls) -> dict[str, bool]:
    """{field name: required} of an mlx-lm ``ModelArgs``-like class."""
    try:
        params = inspect.signature(args_cls).parameters
    except (TypeError, ValueError):
        return {}
    return {k: p.default is inspect.Parameter.empty for k, p in params.items()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def _text_args_class(module, text_config: dict):
    """The mlx-lm arguments class a composite model builds its text model from: the
    ``ModelArgs`` of mlx-lm's module for the text model type (gemma3 -> gemma3_text),
    else a ``*Text*`` args class of the model's own module (llama4 ``TextArgs``,
    qwen3_5 ``TextModelArgs``, gemma3n ``TextConfig``)."""
    from mlx_lm.models.base import BaseModelArgs

    kind = text_config.get("model_type")
    if kind:
        try:
            return importlib.import_module(f"mlx_lm.models.{kind}").ModelArgs
        except (ImportError, AttributeError):
            pass
    for name, obj in vars(module).items():
        if (inspect.isclass(obj) and issubclass(obj, BaseModelArgs) and "Text" in name
                and obj.__module__ == module.__name__):
            return obj
    return None


def _hf_config(config: dict[str, Any]):
    """The transformers config object of a config.json dict (None when transformers
    does not know the model type)."""
    try:
        from transformers import AutoConfig
    except ImportError:
        return None
    kind = config.get("model_type")
    try:
        return AutoConfig.for_model(kind, **{k: v for k, v in config.items()
                                             if k != "model_type"})
    except Exception as e:  # noqa: BLE001 - a config transformers cannot read: no step 1
        log.debug("config shim: transformers cannot read a %s config: %s", kind, e)
        return None


def _plain(value: Any) -> Any:
    """A JSON-like copy of a config value (sub-configs as dicts)."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, tuple):
        return list(value)
    return value


def _translate(config: dict[str, Any], args_cls, hf) -> dict[str, Any]:
    """Overrides for one level of config against one mlx-lm arguments class."""
    out = flat_rope_overrides({k: v for k, v in config.items() if k != "text_config"})
    fields = args_fields(args_cls)
    have = {**config, **out}
    for name, required in fields.items():
        if have.get(name) is not None or name in _NOT_FROM_OBJECT or hf is None:
            continue
        value = getattr(hf, name, _MISSING)
        if value is _MISSING or (value is None and not required):
            continue
        try:
            json.dumps(_plain(value))
        except (TypeError, ValueError):
            continue
        out[name] = have[name] = _plain(value)
    kind = config.get("model_type")
    for name, rule in _PER_MODEL.get(kind, {}).items():
        if name in fields and have.get(name) is None:
            value = rule(have)
            if value is not None:
                out[name] = have[name] = value
    for name, rule in _DEFAULTS.items():
        if name in fields and name not in have:
            value = rule(have)
            if value is not None:
                out[name] = have[name] = value
    if fields.get("rope_scaling") and "rope_scaling" not in have:
        out["rope_scaling"] = None  # plain RoPE; exaone4's ModelArgs requires the field
    return out


def config_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """What to add to a config.json dict so that mlx-lm reads it as the checkpoint
    means it (see the module docstring); a value already there is never replaced."""
    module = mlx_model_module(config)
    hf = _hf_config(config)
    out = _translate(config, module.ModelArgs, hf)
    text = config.get("text_config")
    if isinstance(text, dict):
        text_cls = _text_args_class(module, text)
        if text_cls is not None:
            inner = _translate(text, text_cls, getattr(hf, "text_config", None))
            if inner:
                out["text_config"] = {**text, **inner}
    return out


def _rope(config: dict[str, Any], key: str) -> Any:
    rope = config.get("rope_parameters")
    return rope.get(key) if isinstance(rope, dict) else None


# Defaults the transformers modelling code applies when a config leaves a value out.
_DEFAULTS = {
    "head_dim": lambda c: (c["hidden_size"] // c["num_attention_heads"]
                           if c.get("hidden_size") and c.get("num_attention_heads") else None),
}

# Per-model keys under names only one mlx-lm model file reads.
_PER_MODEL: dict[str, dict[str, Any]] = {
    # mlx_lm/models/lfm2.py: the conv/attention block width, ``block_dim`` in LFM2's
    # original config, is the hidden size (transformers 5 dropped the key)
    "lfm2": {"block_dim": lambda c: c.get("hidden_size")},
    # mlx_lm/models/gpt_neox.py: GPT-NeoX's original names for RoPE base and fraction
    "gpt_neox": {"rotary_emb_base": lambda c: c.get("rope_theta") or _rope(c, "rope_theta"),
                 "rotary_pct": lambda c: (c.get("partial_rotary_factor")
                                          or _rope(c, "partial_rotary_factor"))},
}


def resolve_model_dir(model: str | Path) -> Path:
    """A local model dir, or a hub id already in the local Hugging Face cache."""
    path = Path(model)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(model), local_files_only=True))
    except Exception as e:  # noqa: BLE001 - any miss is the same error for the user
        raise FileNotFoundError(
            f"model {model!r} not found: pass a local Hugging Face model dir or a hub id "
            "that is already downloaded. Example: yeto make-tiny-model runs/tiny && "
            "python -m yeto.mlx.learner --model runs/tiny ...") from e


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """config.json as a dict (what `yeto.targets.select_targets` is given)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --model must be a Hugging Face model dir")
    return json.loads(path.read_text())


def load_model(model_dir: str | Path, *, lazy: bool = False, dtype: str | None = "float32"):
    """Build the mlx-lm model for a Hugging Face model dir, with the shims applied.

    Returns ``(model, config)``. The weights are cast to ``dtype`` (float32 by
    default, as the torch island loads them), so both islands compute the same
    function.
    """
    import mlx.core as mx
    from mlx_lm.utils import load_config
    from mlx_lm.utils import load_model as _load_model

    model_dir = resolve_model_dir(model_dir)
    overrides = config_overrides(load_config(model_dir))
    if overrides:
        log.debug("config shim: %s", overrides)
    model, config = _load_model(model_dir, lazy=lazy, model_config=overrides or None)
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
        if not lazy:
            mx.eval(model.parameters())
    return model, config


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
