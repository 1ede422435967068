"""Loading a Hugging Face model dir with mlx-lm, whatever transformers wrote it.

The config is translated first (`yeto.mlx.config.config_overrides`).

**The built model** (`_classes`, given to mlx-lm's loader): weights in a layout
transformers writes but mlx-lm's ``sanitize`` does not read are translated first
(`yeto.mlx.checkpoint`: gpt2's ``transformer.`` prefix, gpt-oss experts, renamed norms, ...);
settings mlx-lm hard-codes where the config says otherwise are set from the config
(`_MODEL_FIXES`: glm's partial RoPE, recurrent_gemma's norm eps; `_LATENT_EPS_TYPES`: the
MLA latent norms' eps); layer kinds a file
places by a period or a hard-coded plan are built per layer as the config lists them
(`yeto.mlx.layer_kinds`; `yeto.mlx.layer_plan`: Llama 4's RoPE and chunking); a RoPE scaling
the file's constructor refuses is hidden from it and applied afterwards
(`yeto.mlx.rope_files`, `yeto.mlx.rope`); and a model whose
``__init__`` skips ``nn.Module.__init__`` is completed. What cannot be translated
(a different architecture under the same model type, a computation mlx-lm
hard-codes) is listed with its reason by ``scripts/arch_sweep.py``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from yeto.mlx import heads, layer_kinds, layer_plan, minicpm3, rope_files
from yeto.mlx.activations import patch_activations
from yeto.mlx.checkpoint import read_weights_as_written
from yeto.mlx.config import (
    FULL,
    SLIDING,
    config_overrides,
    layer_types_of,
    mlx_lm_classes,
    rope_of,
)
from yeto.mlx.errors import UnsupportedConfig
from yeto.mlx.rebind import Namespace, rebind
from yeto.mlx.rope import fix_rope

log = logging.getLogger("yeto.mlx.shims")


def _where(args_cls) -> str:
    return f"mlx-lm's {getattr(args_cls, '__module__', 'mlx_lm').rsplit('.', 1)[-1]}.py"


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
    model, config = _load_model(model_dir, lazy=lazy, model_config=overrides or None,
                                get_model_classes=_classes)
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
        if not lazy:
            mx.eval(model.parameters())
    return model, config


# ---- built models -------------------------------------------------------------------
def _glm_rope(model, args, config: dict) -> None:
    """mlx_lm/models/glm.py rotates the whole head; GLM-4 (transformers' glm) rotates the
    first ``partial_rotary_factor`` of it (0.5 in GLM-4 checkpoints), pairs interleaved."""
    import mlx.nn as nn

    factor = (config.get("partial_rotary_factor")
              or rope_of(config, FULL, "partial_rotary_factor") or 1.0)
    for layer in model.layers:
        attn = layer.self_attn
        dims = int(attn.head_dim * factor)
        if dims != attn.rope.dims:
            attn.rope = nn.RoPE(dims=dims, traditional=True, base=args.rope_theta)


def _recurrent_gemma_eps(model, args, config: dict) -> None:
    """mlx_lm/models/recurrent_gemma.py builds its block norms with eps 1e-5 and only
    the final norm with the config's rms_norm_eps (1e-6 in RecurrentGemma checkpoints),
    which transformers uses everywhere."""
    for block in model.layers:
        for name in ("temporal_pre_norm", "channel_pre_norm"):
            getattr(block, name).eps = args.rms_norm_eps


def _recurrent_gemma_rope(model, args, config: dict) -> None:
    """mlx_lm/models/recurrent_gemma.py builds its attention's RoPE with base 10000 (the
    nn.RoPE default); transformers rotates with the config's rope_theta."""
    theta = getattr(args, "rope_theta", None)
    for block in model.layers:
        rope = getattr(block.temporal_block, "rope", None)
        if theta and rope is not None and rope.base != theta:
            rope.base = float(theta)


def _gpt_neox_width(model, args, config: dict) -> None:
    """mlx_lm/models/gpt_neox.py builds the MLP 4 x hidden wide (as in Pythia); transformers
    reads intermediate_size (any width)."""
    import mlx.nn as nn

    width = config.get("intermediate_size")
    for layer in getattr(model.model, "h", []):
        mlp = layer.mlp
        if width and mlp.dense_h_to_4h.weight.shape[0] != width:
            mlp.dense_h_to_4h = nn.Linear(args.hidden_size, width)
            mlp.dense_4h_to_h = nn.Linear(width, args.hidden_size)


def _gemma3_embed_scale(model, args, config: dict) -> None:
    """mlx_lm/models/gemma3_text.py rounds the embedding scale sqrt(hidden_size) to
    bfloat16 (as Gemma's own code does); transformers computes it in the model's dtype,
    1e-3 apart where bfloat16 cannot hold the root (hidden 48, 96). Rounded to the
    model's dtype here too (float32 -> exact; bfloat16 -> as before)."""
    import mlx.core as mx

    rebind(model, "mlx_lm.models.gemma3_text",
           {"mx": Namespace(mx, {"bfloat16": mx.float32})}, key="gemma3-scale")


def _nanochat_eps(model, args, config: dict) -> None:
    """mlx_lm/models/nanochat.py normalises with eps 1e-5 everywhere (its rms_norm);
    transformers' NanoChat with the config's rms_norm_eps (default 1e-6)."""
    import mlx.core as mx

    eps = config.get("rms_norm_eps")
    if eps is not None:
        rebind(model, "mlx_lm.models.nanochat",
               {"rms_norm": lambda x: mx.fast.rms_norm(x, None, eps)}, key=("nanochat", eps))


# model types whose transformers MLA normalises its latents (``q_a_layernorm``,
# ``kv_a_layernorm``) with its RMSNorm's default eps 1e-6 where the mlx-lm file uses
# another: nn.RMSNorm's default 1e-5 (longcat_flash.py, minicpm3.py) or the config's
# rms_norm_eps (kimi_linear.py, glm4_moe_lite.py)
_LATENT_EPS_TYPES = {"longcat_flash", "minicpm3", "kimi_linear", "glm4_moe_lite"}
_LATENT_EPS = 1e-6


def _latent_norm_eps(model, config: dict) -> list[str]:
    """Every MLA latent norm of a `_LATENT_EPS_TYPES` model with the eps transformers
    uses (`_LATENT_EPS`); run after layers are built again, so that rebuilt layers get
    it too."""
    import mlx.nn as nn

    if config.get("model_type") not in _LATENT_EPS_TYPES:
        return []
    done = []
    for path, module in model.named_modules():
        for name in ("q_a_layernorm", "kv_a_layernorm"):
            norm = module.get(name) if isinstance(module, dict) else None
            if isinstance(norm, nn.RMSNorm) and norm.eps != _LATENT_EPS:
                norm.eps = _LATENT_EPS
                done.append(f"{path}.{name}: eps {_LATENT_EPS}")
    return done


def _drop_appended_layer(model, args, config: dict) -> None:
    """A file of `_BUILDS_PER_KIND` built a layer from the entry `_one_kind_lists`
    appended past the last layer: dropped before the weights load (never evaluated),
    so the model has the config's layers, every one of the config's kind."""
    n = args.num_hidden_layers
    if len(getattr(args, "layer_types", None) or ()) != n + 1:
        return
    owner = next(m for _, m in model.named_modules()
                 if isinstance(m.get("layers") if isinstance(m, dict) else None, list)
                 and len(m["layers"]) == n + 1)
    owner.layers = owner["layers"][:n]


def _jamba_router(model, args, config: dict) -> None:
    """mlx_lm/models/jamba.py weights the chosen experts by a softmax over the chosen
    router logits (renormalised); transformers' Jamba by the softmax over all experts,
    unnormalised: the chosen logits become log-probabilities over all experts, and their
    exp the weights."""
    import mlx.core as mx

    def chosen(gates, inds, axis=-1):
        return mx.take_along_axis(gates - mx.logsumexp(gates, axis=-1, keepdims=True), inds,
                                  axis=axis)

    rebind(model, "mlx_lm.models.jamba",
           {"mx": Namespace(mx, {"take_along_axis": chosen,
                                 "softmax": lambda x, axis=-1, precise=False: mx.exp(x)})},
           key="jamba-router")


def _exaone_rope(model, args, config: dict) -> None:
    """transformers' EXAONE 4 / EXAONE-MoE rotate a layer only when it is a sliding one
    or the config has no sliding window; mlx_lm/models/exaone4.py and exaone_moe.py
    rotate every layer when no layer is a sliding one. Layers transformers does not
    rotate stop rotating."""
    types = layer_types_of(config)
    if types is None or config.get("sliding_window") is None:
        return
    for layer, kind in zip(model.layers, types):
        if kind != SLIDING:
            layer.self_attn.use_rope = False


# model type -> settings of the built mlx-lm model that mlx-lm leaves at a constant where
# the checkpoint's config says otherwise (applied before the weights load)
_MODEL_FIXES = {"glm": (_glm_rope,),
                "recurrent_gemma": (_recurrent_gemma_eps, _recurrent_gemma_rope),
                "gpt_neox": (_gpt_neox_width,), "gemma3": (_gemma3_embed_scale,),
                "gemma3_text": (_gemma3_embed_scale,), "nanochat": (_nanochat_eps,),
                "exaone4": (_exaone_rope,), "exaone_moe": (_exaone_rope,),
                "jamba": (_jamba_router,),
                "afmoe": (_drop_appended_layer,),
                "minicpm3": (minicpm3.fit_values, minicpm3.scale_tied_head)}


def _classes(config: dict):
    """mlx-lm's (Model, ModelArgs) with adapters on the built model: a Model whose
    ``__init__`` skips ``nn.Module.__init__`` (mlx_lm/models/recurrent_gemma.py) is
    completed, so that freezing and LoRA work on it; settings mlx-lm hard-codes are
    set from the config (`_MODEL_FIXES`); and weights in a layout transformers writes
    but mlx-lm's ``sanitize`` does not read are translated first (`yeto.mlx.checkpoint`,
    text-only checkpoints of composite models)."""
    model_cls, args_cls = mlx_lm_classes(config)

    def build(args):
        with rope_files.layouts_recorded():  # rotaries built here, in layers built again too
            model, args = _construct(model_cls, args, config)
            if "_no_grad" not in vars(model):
                model._no_grad = set()
                model._training = True
            for repair in _MODEL_FIXES.get(config.get("model_type"), ()):
                repair(model, args, config)
            patched = _layers_as_listed(model, model_cls, config)
        patched += _latent_norm_eps(model, config)
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
    (`layer_plan`, after layer_kinds and before fix_rope); returns what was done."""
    try:
        patched = layer_kinds.rebuild_layers(model, config)
    except (ValueError, TypeError) as e:
        raise UnsupportedConfig(
            f"layer kinds {config.get(layer_kinds.KEY)}: {_where(model_cls)} places "
            f"them periodically and its layers cannot be rebuilt one by one ({e})") from e
    return patched + layer_kinds.repair_indices(model) + layer_plan.follow_config(model, config)


def _unbuildable(config: dict, model_cls, e: Exception) -> Exception:
    """mlx-lm refused to build its arguments or model from the config: an
    `UnsupportedConfig` that names what the config asks (one layer kind only, a RoPE
    type) or quotes mlx-lm's own check (an assertion or ValueError raised in mlx-lm's
    code, "hidden_size must be divisible by num_heads"); anything else is ``e`` itself."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    in_mlx_lm = bool(frames) and "mlx_lm" in Path(frames[-1].filename).parts
    where, cause = _where(model_cls), f"({type(e).__name__}: {e})"
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
