"""A Hugging Face model dir loaded into an mlx-lm model that computes what transformers'
model computes, whatever transformers version wrote it.

`load_model` hands mlx-lm's loader (``mlx_lm.utils.load_model``) the model dir with
the config translated (`yeto.mlx.config.config_overrides`) and `model_classes` as its
``get_model_classes``, which builds the model as mlx-lm's file does and then:

- refusals said as what the config asks (`UnsupportedConfig`: a layer kind, a RoPE
  type, mlx-lm's own check), and a RoPE scaling the file's constructor refuses hidden
  from it and applied afterwards (`yeto.mlx.rope_files`);
- a model whose ``__init__`` skips ``nn.Module.__init__`` (recurrent_gemma.py)
  completed, so that freezing and LoRA work on it;
- settings the file hard-codes where the config says otherwise set from the config
  (`yeto.mlx.models`);
- layer kinds a file places by a period or a hard-coded plan built per layer as the
  config lists them (`yeto.mlx.layer_kinds`; `yeto.mlx.models.llama4`: Llama 4's RoPE
  and chunking);
- the config's activation, head width and RoPE (`yeto.mlx.activations`,
  `yeto.mlx.heads`, `yeto.mlx.rope`);
- the checkpoint read as transformers wrote it (`yeto.mlx.checkpoint`).

What cannot be translated (a different architecture under the same model type, a
computation mlx-lm hard-codes) is listed with its reason by ``scripts/arch_sweep.py``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from yeto.mlx import heads, layer_kinds, models, rope_files
from yeto.mlx.activations import patch_activations
from yeto.mlx.checkpoint import read_weights_as_written
from yeto.mlx.config import config_overrides, mlx_lm_classes
from yeto.mlx.errors import UnsupportedConfig, mlx_file
from yeto.mlx.models import llama4, mla
from yeto.mlx.rope import fix_rope

log = logging.getLogger("yeto.mlx.load")


def resolve_model_dir(model: str | Path) -> Path:
    """A local model dir, a .gguf file (read once into a cached model dir: `yeto.gguf`),
    or a hub id already in the local Hugging Face cache."""
    from yeto import gguf

    path = Path(model)
    if path.is_dir():
        return path
    if gguf.is_gguf(path):
        return gguf.model_dir(path)
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
    """Build the mlx-lm model for a Hugging Face model dir (a .gguf file, a hub id in
    the local cache: `resolve_model_dir`) and load its weights (module docstring).

    Returns ``(model, config)``, the config as mlx-lm read it (translated). The
    weights are cast to ``dtype`` (float32 by default, as the torch island loads them),
    so both islands compute the same function.
    """
    import mlx.core as mx
    from mlx_lm.utils import load_config
    from mlx_lm.utils import load_model as _load_model

    model_dir = resolve_model_dir(model_dir)
    overrides = config_overrides(load_config(model_dir))
    if overrides:
        log.debug("config translated: %s", overrides)
    model, config = _load_model(model_dir, lazy=lazy, model_config=overrides or None,
                                get_model_classes=model_classes)
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
        if not lazy:
            mx.eval(model.parameters())
    return model, config


def model_classes(config: dict):
    """mlx-lm's ``get_model_classes`` for a translated config: (build, arguments class).
    ``build(args)`` builds mlx-lm's model and makes it what the config means (module
    docstring); the arguments class is mlx-lm's ``ModelArgs``, its refusals said as
    `UnsupportedConfig` (`_CheckedArgs`)."""
    model_cls, args_cls = mlx_lm_classes(config)

    def build(args):
        with rope_files.layouts_recorded():  # rotaries built here, in layers built again too
            model, args = _construct(model_cls, args, config)
            if "_no_grad" not in vars(model):
                model._no_grad = set()
                model._training = True
            models.repair(model, args, config)
            patched = _layers_as_listed(model, model_cls, config)
        patched += mla.latent_norm_eps(model, config)
        patched += patch_activations(model, config.get("model_type"), config)
        patched += heads.fit_heads(model, args, config)  # before fix_rope: it scales the RoPE
        patched += fix_rope(model, args, config)
        if patched:
            log.debug("built model: %s", "; ".join(patched))
        read_weights_as_written(model, args, config)
        return model

    return build, _CheckedArgs(args_cls, model_cls, config)


def _construct(model_cls, args, config: dict):
    """(model, args) as mlx-lm builds them (`heads.build`: cohere2's head_dim); a RoPE
    scaling the constructor refuses is hidden from it (`rope_files.hidden_build`, then
    `fix_rope` applies it); any other refusal is said by `_unbuildable`."""
    try:
        return heads.build(model_cls, args, config), args
    except Exception as e:  # noqa: BLE001 - said as what the config asks of mlx-lm
        hidden = rope_files.hidden_build(lambda a: heads.build(model_cls, a, config), args)
        if hidden is None:
            raise _unbuildable(config, model_cls, e) from e
        return hidden


def _layers_as_listed(model, model_cls, config: dict) -> list[str]:
    """The built model's layers as the config lists them: kinds rebuilt layer by layer
    (`layer_kinds`), indices past the last layer repaired, Llama 4's plan
    (`llama4`, after layer_kinds and before fix_rope); returns what was done."""
    try:
        patched = layer_kinds.rebuild_layers(model, config)
    except (ValueError, TypeError) as e:
        raise UnsupportedConfig(
            f"layer kinds {config.get(layer_kinds.KEY)}: {mlx_file(model_cls)} places "
            f"them periodically and its layers cannot be rebuilt one by one ({e})") from e
    return patched + layer_kinds.repair_indices(model) + llama4.follow_config(model, config)


def _unbuildable(config: dict, model_cls, e: Exception) -> Exception:
    """mlx-lm refused to build its arguments or model from the config: an
    `UnsupportedConfig` that names what the config asks (one layer kind only, a RoPE
    type) or quotes mlx-lm's own check (an assertion or ValueError raised in mlx-lm's
    code, "hidden_size must be divisible by num_heads"); anything else is ``e`` itself."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    in_mlx_lm = bool(frames) and "mlx_lm" in Path(frames[-1].filename).parts
    where, cause = mlx_file(model_cls), f"({type(e).__name__}: {e})"
    kinds = _one_kind(config)
    text = str(e)
    if kinds is not None and (isinstance(e, IndexError) or "not in list" in text
                              or "substring not found" in text):
        return UnsupportedConfig(f"{kinds[0]}: only {kinds[1]!r} layers: {where} needs a "
                                 f"layer of each kind {cause}")
    scaling = next((c.get("rope_scaling") for c in (config, config.get("text_config"))
                    if isinstance(c, dict) and isinstance(c.get("rope_scaling"), dict)), None)
    if scaling is not None and (any(f.filename.endswith("rope_utils.py") for f in frames)
                                or "rope" in text.lower()):
        kind = scaling.get("rope_type", scaling.get("type"))
        return UnsupportedConfig(f"rope_parameters.rope_type={kind!r}: {where} cannot build "
                                 f"that RoPE {cause}")
    if in_mlx_lm and isinstance(e, (AssertionError, ValueError)) and text:
        return UnsupportedConfig(f"{where} refuses this config: {text}")
    return e


class _CheckedArgs:
    """mlx-lm's ModelArgs class, its refusals said as `_unbuildable` says them."""

    def __init__(self, args_cls, model_cls, config: dict):
        self.args_cls, self.model_cls, self.config = args_cls, model_cls, config

    def from_dict(self, params: dict):
        try:
            return self.args_cls.from_dict(params)
        except Exception as e:  # noqa: BLE001 - said as what the config asks of mlx-lm
            hidden = rope_files.hidden_args(self.args_cls, params)  # the scaling refused
            if hidden is None:
                raise _unbuildable(self.config, self.model_cls, e) from e
            return hidden

    def __getattr__(self, name: str):
        return getattr(self.args_cls, name)


def _one_kind(config: dict) -> tuple[str, str] | None:
    """(list, kind) when a per-layer list of the config has one kind only."""
    for level in (config, config.get("text_config")):
        for key in ("layer_types", "mlp_layer_types"):
            types = level.get(key) if isinstance(level, dict) else None
            if isinstance(types, list) and len(types) > 1 and len(set(map(str, types))) == 1:
                return key, str(types[0])
    return None
