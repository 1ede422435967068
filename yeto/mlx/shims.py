"""Loading a Hugging Face model dir with mlx-lm, whatever transformers wrote it.

The config is translated first (`yeto.mlx.config.config_overrides`).

**The built model** (`_classes`, given to mlx-lm's loader): weights in a layout
transformers writes but mlx-lm's ``sanitize`` does not read are translated first
(`_WEIGHTS`: gpt2's ``transformer.`` prefix, gpt-oss experts, renamed norms, ...);
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
import re
from pathlib import Path
from typing import Any

from yeto.mlx import heads, layer_kinds, layer_plan, minicpm3, rope_files
from yeto.mlx.activations import patch_activations
from yeto.mlx.config import (
    FULL,
    SLIDING,
    TEXT_ONLY,
    config_overrides,
    layer_types_of,
    mlx_lm_classes,
    rope_of,
)
from yeto.mlx.errors import UnsupportedConfig
from yeto.mlx.rebind import Namespace, rebind
from yeto.mlx.rope import fix_rope
from yeto.mlx.structure import reconcile

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


# ---- checkpoint layouts ---------------------------------------------------------------
def _gpt2_weights(weights: dict, args=None) -> dict:
    """mlx_lm/models/gpt2.py reads the original GPT-2 layout (``h.0.attn...``);
    transformers writes ``transformer.h.0.attn...``."""
    out = {}
    for k, v in weights.items():  # an untied lm_head: yeto.mlx.structure
        out[k[len("transformer."):] if k.startswith("transformer.") else k] = v
    return out


def _gpt_oss_weights(weights: dict, args=None) -> dict:
    """mlx_lm/models/gpt_oss.py reads OpenAI's release layout (MXFP4 ``*_blocks``, or
    (experts, out, in) ``.weight`` arrays); transformers writes unquantized experts
    as (experts, in, out) arrays without a ``.weight`` suffix."""
    import mlx.core as mx

    out = {}
    for k, v in weights.items():
        if k.endswith((".experts.gate_up_proj", ".experts.down_proj")) and v.ndim == 3:
            out[f"{k}.weight"] = mx.swapaxes(v, 1, 2)
        else:
            out[k] = v
    return out


def _kimi_linear_weights(weights: dict, args=None) -> dict:
    """mlx_lm/models/kimi_linear.py reads a dense layer's MLP under ``mlp.``;
    transformers writes it under ``block_sparse_moe.`` as the MoE layers."""
    dense = re.compile(r"\.block_sparse_moe\.((?:gate|up|down)_proj\.weight)$")
    return {dense.sub(r".mlp.\1", k): v for k, v in weights.items()}


def _text_only_weights(model):
    """For a text-only checkpoint loaded into a composite mlx-lm model
    (`text_only_remap`): its text model's weights (``model.*``, ``lm_head.*``) moved
    to where the composite keeps them (llama4 ``language_model.model.*``, gemma3n
    ``model.language_model.*``), as in the composite checkpoints. A checkpoint that
    already has that layout is left as it is."""
    paths = {p for p, _ in model.named_modules()}
    embed = min((p for p in paths if p.endswith(".embed_tokens")), key=len, default=None)
    if embed is None:
        return None
    inner = embed[:-len(".embed_tokens")]
    outer = inner.rsplit(".", 1)[0] if "." in inner else ""
    head = f"{outer}.lm_head" if outer else "lm_head"

    def translate(weights: dict, args=None) -> dict:
        if inner == "model" or any(k.startswith((f"{inner}.", "language_model.",
                                                 "model.language_model.")) for k in weights):
            return weights
        out = {}
        for k, v in weights.items():
            if k.startswith("model."):
                out[f"{inner}.{k[len('model.'):]}"] = v
            elif k.startswith("lm_head.") and head in paths:
                out[f"{head}.{k[len('lm_head.'):]}"] = v
            elif not k.startswith("lm_head."):  # a tied head has no module
                out[k] = v
        return out

    return translate


def _renamed(pairs: list[tuple[str, str]]):
    """Weights renamed by regular expressions (the first that matches)."""
    compiled = [(re.compile(a), b) for a, b in pairs]

    def rename(weights: dict, args=None) -> dict:
        out = {}
        for k, v in weights.items():
            for pattern, repl in compiled:
                k, n = pattern.subn(repl, k)
                if n:
                    break
            out[k] = v
        return out

    return rename


# mlx_lm/models/olmo_hybrid.py reads the layer norms of its linear-attention layers
# under transformers' module names; transformers writes OLMo-Hybrid's original ones
_olmo_hybrid_weights = _renamed([(r"\.attention_layer_norm\.", ".input_layernorm."),
                                 (r"\.feedforward_layer_norm\.", ".post_attention_layernorm.")])

# mlx_lm/models/nanochat.py reads nanochat's own export (transformer.h.N.attn.c_q,
# transformer.wte); transformers writes model.layers.N.self_attn.q_proj, model.embed_tokens
_nanochat_weights = _renamed([
    (r"^model\.embed_tokens\.", "transformer.wte."),
    (r"^model\.layers\.(\d+)\.self_attn\.q_proj\.", r"transformer.h.\1.attn.c_q."),
    (r"^model\.layers\.(\d+)\.self_attn\.k_proj\.", r"transformer.h.\1.attn.c_k."),
    (r"^model\.layers\.(\d+)\.self_attn\.v_proj\.", r"transformer.h.\1.attn.c_v."),
    (r"^model\.layers\.(\d+)\.self_attn\.o_proj\.", r"transformer.h.\1.attn.c_proj."),
    (r"^model\.layers\.(\d+)\.mlp\.fc1\.", r"transformer.h.\1.mlp.c_fc."),
    (r"^model\.layers\.(\d+)\.mlp\.fc2\.", r"transformer.h.\1.mlp.c_proj."),
])


def _stacked_experts(weights: dict, args=None) -> dict:
    """mlx_lm/models/qwen3_5_moe.py reads the experts fused (``experts.gate_up_proj``);
    transformers writes one linear per expert (``experts.<e>.gate_proj.weight``):
    stacked here into the ``switch_mlp`` arrays mlx-lm builds."""
    import mlx.core as mx

    per_expert = re.compile(r"^(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    groups: dict[tuple[str, str], dict[int, Any]] = {}
    out = {}
    for k, v in weights.items():
        m = per_expert.match(k)
        if m is None:
            out[k] = v
        else:
            groups.setdefault((m[1], m[3]), {})[int(m[2])] = v
    for (prefix, name), experts in groups.items():
        out[f"{prefix}.switch_mlp.{name}.weight"] = mx.stack(
            [experts[i] for i in sorted(experts)])
    return out


def _longcat_weights(weights: dict, args) -> dict:
    """transformers' LongcatFlash holds weights for its zero-compute (identity)
    experts too, unused; mlx_lm/models/longcat_flash.py has only the routed ones."""
    expert = re.compile(r"\.mlp\.experts\.(\d+)\.")
    return {k: v for k, v in weights.items()
            if not ((m := expert.search(k)) and int(m[1]) >= args.n_routed_experts)}


_OFFSET_NORM = re.compile(r"(\.input_layernorm|\.post_attention_layernorm|\.q_norm|\.k_norm"
                          r"|(^|\.)(model|language_model)\.norm)\.weight$")


def _offset_norms(weights: dict, args=None) -> dict:
    """mlx_lm/models/qwen3_5.py adds 1 to the (1 + w) RMSNorm
    weights transformers writes only when it sees a transformers-layout conv1d weight;
    a checkpoint without linear-attention layers has none, so the weights (always
    transformers-written here) are shifted before."""
    if any("conv1d.weight" in k for k in weights):
        return weights
    return {k: v + 1.0 if _OFFSET_NORM.search(k) and v.ndim == 1 else v
            for k, v in weights.items()}


# model type -> translation of the transformers-written weights, before mlx-lm's sanitize
_WEIGHTS = {"gpt2": _gpt2_weights, "gpt_oss": _gpt_oss_weights,
            "kimi_linear": _kimi_linear_weights, "qwen3_5": _offset_norms,
            "qwen3_5_moe": lambda w, a=None: _offset_norms(_stacked_experts(w, a), a),
            "olmo_hybrid": _olmo_hybrid_weights, "nanochat": _nanochat_weights,
            "longcat_flash": _longcat_weights,
            # mlx_lm/models/mimo_v2_flash.py names the attention sinks attention_sink_bias
            "mimo_v2_flash": _renamed([(r"\.self_attn\.sinks$", ".self_attn.attention_sink_bias")])}


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
    but mlx-lm's ``sanitize`` does not read are translated first (`_WEIGHTS`,
    text-only checkpoints of composite models)."""
    model_cls, args_cls = mlx_lm_classes(config)
    translate = _WEIGHTS.get(config.get("model_type"))
    text_only = bool(config.get(TEXT_ONLY))

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
        fix = translate or (_text_only_weights(model) if text_only else None)
        sanitize = getattr(model, "sanitize", lambda w: w)
        object.__setattr__(model, "sanitize", lambda w: reconcile(
            model, sanitize(fix(w, args) if fix is not None else w)))
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
