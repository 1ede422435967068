"""Tiny random-weight models of any architecture transformers can build.

`tiny_model` writes one (config.json + model.safetensors, float32) for the torch/MLX
parity checks (`yeto.interop.parity`): `scripts/arch_sweep.py` and the tests. The
config is the architecture's own default shrunk to `TINY` sizes, with
`TINY_OVERRIDES` where the defaults do not look like the real checkpoints. A model
that cannot be built raises `ParityError` with stage ``tiny``.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

from yeto.interop.parity import LAYER_COUNTS, ParityError

log = logging.getLogger(__name__)

#: small sizes, under the config's own attribute names or their `attribute_map` aliases;
#: a key is set only where the architecture's config has it (or an alias of it). Six
#: layers: hybrids with a layer pattern (gemma3 5:1 sliding/full, qwen3_5 3:1
#: linear/full, jamba's attention at layer 4 of 8) keep at least one layer of each kind.
TINY_LAYERS = 6
TINY: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": TINY_LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 256,
    # configs that use other names and no attribute_map (dbrx)
    "d_model": 64, "n_heads": 4, "n_layers": TINY_LAYERS, "num_layers": TINY_LAYERS,
    "max_seq_len": 256,
    "ffn_hidden_size": 128, "kv_n_heads": 2,
    # mixture of experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_k": 2, "moe_top_k": 2,
    "top_k": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32, "n_shared_experts": 1, "num_shared_experts": 1,
    "n_group": 1, "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "zero_expert_num": 2,
    # multi-head latent attention (rotary part = head_dim, as transformers sets it)
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
    "qk_head_dim": 32, "v_head_dim": 16,
    # state-space / linear attention / recurrent blocks: inner width 2 x hidden
    "state_size": 8, "ssm_state_size": 8, "mamba_d_state": 8, "time_step_rank": 8,
    "mamba_dt_rank": 8, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_head_dim": 16,
    "mamba_d_ssm": 128, "n_groups": 1, "mamba_n_groups": 1, "mamba_chunk_size": 16,
    "chunk_size": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_heads": 4,
    "linear_head_dim": 16, "lru_width": 64, "rotary_dim": 8,
    # per-layer token embeddings (gemma3n, gemma4)
    "vocab_size_per_layer_input": 256, "hidden_size_per_layer_input": 16,
    # vision / audio towers of composite (image-text) configs
    "image_size": 32, "patch_size": 8, "num_channels": 3,
}
_MOE_SIZES = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
              "num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_top_k", "top_k",
              "moe_intermediate_size", "shared_expert_intermediate_size",
              "shared_intermediate_size", "n_shared_experts", "num_shared_experts"}


def _tiny_entry(value: Any) -> Any:
    """A per-layer config entry ({"head_dim": 512}) at `TINY` sizes."""
    if isinstance(value, dict):
        return {k: TINY.get(k, v) if isinstance(v, int) else v for k, v in value.items()}
    return value


def _init_default(config_cls, key: str) -> Any:
    try:
        param = inspect.signature(config_cls.__init__).parameters.get(key)
    except (TypeError, ValueError):
        return inspect.Parameter.empty
    return inspect.Parameter.empty if param is None else param.default


def _tokens_inside_vocab(d: dict, out: dict) -> None:
    """Token ids at or past the tiny vocabulary's end, moved inside it (in `out`)."""
    vocab = out.get("vocab_size", d.get("vocab_size"))
    if not isinstance(vocab, int):
        return
    for i, key in enumerate(k for k in d if k.endswith(("_token_id", "_token_index"))):
        v = d[key]
        if isinstance(v, int) and v >= vocab:
            out[key] = vocab - 1 - i % 8
        elif isinstance(v, list) and any(isinstance(x, int) and x >= vocab for x in v):
            out[key] = [x if x < vocab else vocab - 1 - i % 8 for x in v]


def _shrink(default, extra: dict) -> dict:
    """Constructor kwargs for a tiny version of a transformers config object: the
    `TINY` sizes it has; its per-layer lists left for the class to derive for the new
    layer count (or cut to the first layers' entries where the class cannot), dicts
    keyed by layer index cut the same way; token ids outside the tiny vocabulary moved
    inside it; sub-configs shrunk alike."""
    from transformers import PretrainedConfig

    d = default.to_dict()
    amap = getattr(default, "attribute_map", {}) or {}
    out: dict[str, Any] = {}
    dense = any(k.startswith(("enable_moe", "use_moe")) and v is False for k, v in d.items())
    for key, value in {**TINY, **extra}.items():
        name = key if key in d else amap.get(key)
        if name is None or name not in d or name in out or isinstance(value, dict):
            continue
        if key in _MOE_SIZES and key not in extra and dense:
            continue  # a dense model that only has the fields (gemma4 without its MoE block)
        if key == "q_lora_rank" and d[name] is None:
            continue  # MLA without a query low-rank (DeepSeek-V2-Lite, Kimi-Linear)
        out[name] = value
    if "kv_lora_rank" in d and "num_key_value_heads" in out:
        # multi-head latent attention: one key/value head per query head (as in every
        # MLA checkpoint); transformers repeats keys by heads / num_key_value_heads
        out["num_key_value_heads"] = out.get("num_attention_heads", d.get("num_attention_heads"))
    old_n = next((d[k] for k in LAYER_COUNTS if isinstance(d.get(k), int)), None)
    new_n = next((out[k] for k in LAYER_COUNTS if k in out), None)
    for key, value in d.items():
        if key in out or key in extra or old_n is None or new_n is None or old_n == new_n:
            continue
        if isinstance(value, list) and len(value) == old_n:
            derived = _init_default(type(default), key) is None
            out[key] = None if derived else value[:new_n]
        elif (isinstance(value, dict) and value and key != "rope_parameters"
              and all(isinstance(k, str) and k.isdigit() for k in value)):
            out[key] = {k: _tiny_entry(v) for k, v in value.items() if int(k) < new_n}
    _tokens_inside_vocab(d, out)
    for name in sorted(set(getattr(default, "sub_configs", {}) or {}) | set(d)):
        try:
            sub = getattr(default, name, None)
        except Exception:  # noqa: BLE001 - attributes transformers refuses to read globally
            continue
        if isinstance(sub, PretrainedConfig):
            given = extra.get(name, {})
            if given.get("model_type", sub.model_type) != sub.model_type:
                out[name] = given  # another kind of sub-config, as given
                continue
            kw = _shrink(sub, given)
            if sub.model_type:
                kw["model_type"] = sub.model_type
            out[name] = {**given, **kw}
    for key, value in extra.items():
        if key not in out:
            out[key] = value
    return out


#: per-architecture settings, only where the generic `TINY` sizes cannot make a tiny
#: model shaped like the real checkpoints; each says why
TINY_OVERRIDES: dict[str, dict[str, Any]] = {
    # transformers' default Lfm2Config has attention in every layer; LFM2 checkpoints
    # interleave short-conv blocks (LFM2-350M: 10 conv + 6 attention), and mlx-lm's
    # lfm2.py needs at least one conv layer
    "lfm2": {"layer_types": ["conv", "full_attention", "conv", "conv", "full_attention",
                             "conv"]},
    # transformers' default Lfm2MoeConfig has no layer_types, which its modelling code
    # needs; LFM2-8B-A1B interleaves conv and attention blocks, first layers dense
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "conv", "full_attention",
                                 "conv"], "num_dense_layers": 1},
    # Granite-4.0-H interleaves attention layers among the mamba ones; transformers'
    # default has none (and target selection then finds no attention to adapt)
    "granitemoehybrid": {"layer_types": ["linear_attention", "linear_attention",
                                         "full_attention", "linear_attention",
                                         "linear_attention", "full_attention"]},
    # Llama 4 routes each token to one expert, the only routing mlx-lm's llama4.py has
    "llama4": {"num_experts_per_tok": 1, "text_config": {"num_experts_per_tok": 1}},
    "llama4_text": {"num_experts_per_tok": 1},
    # Gemma 3n shares the KV cache of its last layers (15 of 35 in E2B): transformers
    # then writes no k/v projections for them, which mlx-lm's gemma3n.py builds and
    # loads strictly (Google's checkpoints carry them); the tiny model shares none
    "gemma3n": {"text_config": {"num_kv_shared_layers": 0}},
    # transformers 5.24 saves OLMo-Hybrid's fused q/k/v short convolution split into
    # three equal parts, right only when the key and value widths are equal
    "olmo_hybrid": {"linear_num_value_heads": 2},
    # MiMo-V2-Flash rotates 0.334 of a 192-wide head (64 dims); of the tiny 16 that
    # would be an odd 5, so half of it
    "mimo_v2_flash": {"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4,
                              "partial_rotary_factor": 0.5}}},
    # mamba2's SSM heads: num_heads * head_dim must equal expand * hidden_size
    "mamba2": {"num_heads": 8},
    # transformers 5.24's modeling_dbrx reads attn_config.rope_theta, which
    # DbrxAttentionConfig does not define; DBRX checkpoints carry it (5e5)
    # (and clamps q/k/v to clip_qkv, which its default leaves None: DBRX uses 8)
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8.0},
             "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}},
    # mlx-lm's gpt_neox.py hard-codes the MLP width 4 x hidden, as in GPT-NeoX and
    # Pythia checkpoints
    "gpt_neox": {"intermediate_size": 256},
    # Phi-3.5-MoE has biases on attention and lm_head, and mlx-lm's phimoe.py always
    # builds them; transformers' default config has none
    "phimoe": {"attention_bias": True, "lm_head_bias": True},
    # RecurrentGemma checkpoints attend with one key/value head of hidden/heads
    # dims, which mlx-lm's recurrent_gemma.py hard-codes
    "recurrent_gemma": {"num_key_value_heads": 1},
    # DeepSeek-V2 and MiniCPM3 checkpoints use scaled RoPE (yarn, longrope), which
    # mlx-lm's deepseek_v2.py and minicpm3.py read unconditionally
    "deepseek_v2": {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 0.707}},
    # (MiniCPM3 also: mlx-lm's minicpm3.py divides the hidden states by
    # hidden_size / dim_model_base before the LM head only for untied embeddings,
    # transformers always; the tiny model unties them to check everything else)
    "minicpm3": {"rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.1] * 8,
        "long_factor": [1.5] * 8, "original_max_position_embeddings": 256},
        "tie_word_embeddings": False},
}


def tiny_config(arch: str, overrides: dict | None = None):
    """A transformers config of ``arch`` at `TINY` sizes, with `TINY_OVERRIDES` and
    ``overrides`` (a dict value for a sub-config name overrides inside it)."""
    from transformers import AutoConfig

    extra = dict(TINY_OVERRIDES.get(arch, {}))
    for key, value in (overrides or {}).items():  # a sub-config's settings merge
        both = isinstance(value, dict) and isinstance(extra.get(key), dict)
        extra[key] = {**extra[key], **value} if both else value
    return AutoConfig.for_model(arch, **_shrink(AutoConfig.for_model(arch), extra))


def tiny_model(arch: str, dest: str | Path, seed: int = 0, overrides: dict | None = None) -> Path:
    """Write a tiny random-weight float32 model of ``arch`` (config.json +
    model.safetensors) into ``dest``; returns ``dest``."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        config = tiny_config(arch, overrides)
        torch.manual_seed(seed)
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        except ImportError as e:
            # an image-text model whose vision tower needs a package that is not
            # installed (gemma3n: timm): its text model alone, as a text-only checkpoint
            text = getattr(config, "text_config", None)
            if text is None:
                raise
            log.info("%s: building the text model only (%s)", arch, str(e).strip()[:80])
            model = AutoModelForCausalLM.from_config(text, dtype=torch.float32)
        _randomize(model, seed)
        model.save_pretrained(str(dest), safe_serialization=True)
    except Exception as e:  # noqa: BLE001 - reported with its stage
        raise ParityError("tiny", f"{type(e).__name__}: {e}") from e
    return Path(dest)


def _randomize(model, seed: int) -> None:
    """Norm weights and biases that initialise to constants get random values too,
    so a backend that ignores one (or adds 1 to it, as gemma's RMSNorm does) shows."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim <= 1 and p.numel() > 0 and torch.all(p == p.flatten()[0]):
                p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
