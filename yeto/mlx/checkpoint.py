"""A transformers-written checkpoint read into the mlx-lm model built for it.

mlx-lm's loader reads every ``model*.safetensors`` of the model dir and hands the
weights to the model's ``sanitize`` before loading them. Some mlx-lm files' sanitize
reads another layout than transformers writes (gpt2.py the original GPT-2 names
without ``transformer.``, gpt_oss.py OpenAI's expert arrays, nanochat.py nanochat's own
export, ...). `read_weights_as_written` makes the built model's ``sanitize`` read the
checkpoint as transformers wrote it:

1. the weights translated into the layout the file's sanitize reads, by model type
   (`_LAYOUTS`); a text-only checkpoint loaded into a composite model
   (`yeto.mlx.config.TEXT_ONLY`) gets its weights moved to where the composite keeps
   them (`_text_only_weights`);
2. the file's own ``sanitize``;
3. `yeto.mlx.structure.reconcile`: the model made to hold what the weights hold
   (biases, an untied or tied head).
"""

from __future__ import annotations

import re
from typing import Any

from yeto.mlx.config import TEXT_ONLY
from yeto.mlx.structure import reconcile


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
_LAYOUTS = {"gpt2": _gpt2_weights, "gpt_oss": _gpt_oss_weights,
            "kimi_linear": _kimi_linear_weights, "qwen3_5": _offset_norms,
            "qwen3_5_moe": lambda w, a=None: _offset_norms(_stacked_experts(w, a), a),
            "olmo_hybrid": _olmo_hybrid_weights, "nanochat": _nanochat_weights,
            "longcat_flash": _longcat_weights,
            # mlx_lm/models/mimo_v2_flash.py names the attention sinks attention_sink_bias
            "mimo_v2_flash": _renamed([(r"\.self_attn\.sinks$", ".self_attn.attention_sink_bias")])}


def read_weights_as_written(model, args, config: dict[str, Any]) -> None:
    """Make ``model.sanitize`` (what mlx-lm's loader runs on the checkpoint's weights)
    read the checkpoint of ``config`` as transformers wrote it (module docstring);
    ``args`` are the model's mlx-lm arguments, which some translations read."""
    translate = _LAYOUTS.get(config.get("model_type"))
    if translate is None and config.get(TEXT_ONLY):
        translate = _text_only_weights(model)
    sanitize = getattr(model, "sanitize", lambda w: w)
    object.__setattr__(model, "sanitize", lambda w: reconcile(
        model, sanitize(translate(w, args) if translate is not None else w)))
