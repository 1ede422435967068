"""torch island vs MLX island on architectures other than the llama-style fixtures:
the config translation mlx-lm needs (yeto.mlx.config), names and logits with the same
adapter (yeto.interop.parity), `yeto check-parity`'s last line, and (slow)
the whole architecture sweep.

Here: the checks that need no process, server or training (the others:
tests/integration/test_arch_parity.py, tests/e2e/test_arch_parity.py)."""


import pytest

pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'yeto[mlx]')")


pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'yeto[mlx]')")


from yeto.mlx.config import config_overrides  # noqa: E402
from yeto.testing import archs  # noqa: E402

pytestmark = pytest.mark.mlx


# ---- config translation ---------------------------------------------------------
def _tiny_config(arch: str, **overrides) -> dict:
    return archs.tiny_config(arch, overrides).to_dict()


def test_attribute_map_alias_fills_the_mlx_field():
    """transformers 5's Qwen3MoeConfig keeps the expert count as num_experts behind
    an attribute_map alias; mlx-lm's qwen3_moe ModelArgs requires num_experts."""
    cfg = _tiny_config("qwen3_moe")
    cfg.pop("num_experts", None)
    cfg["num_local_experts"] = 4
    out = config_overrides(cfg)
    assert out["num_experts"] == 4
    assert out["rope_theta"] == cfg["rope_parameters"]["rope_theta"]
    assert out.get("head_dim", cfg.get("head_dim")) == cfg["hidden_size"] // cfg[
        "num_attention_heads"]


def test_per_model_keys_and_layer_types():
    lfm2 = _tiny_config("lfm2")
    lfm2["full_attn_idxs"] = list(range(lfm2["num_hidden_layers"]))  # disagrees: layer_types wins
    out = config_overrides(lfm2)
    assert out["block_dim"] == lfm2["hidden_size"]
    assert out["full_attn_idxs"] == [i for i, t in enumerate(lfm2["layer_types"])
                                     if t == "full_attention"]
    exaone4 = _tiny_config("exaone4")
    out = config_overrides(exaone4)
    assert out["rope_scaling"] is None  # required by mlx-lm's exaone4, plain RoPE here
    assert out["sliding_window_pattern"] == "".join(
        "L" if t == "sliding_attention" else "G" for t in exaone4["layer_types"])


def test_a_value_in_the_config_wins():
    cfg = _tiny_config("qwen3_moe")
    cfg["num_experts"], cfg["rope_theta"] = 8, 123.0
    out = config_overrides(cfg)
    assert "num_experts" not in out and "rope_theta" not in out


def test_mixture_of_experts_layer_list():
    """transformers 5 lists dense/sparse per layer where mlx-lm's exaone_moe reads
    is_moe_layer (and deepseek-style models first_k_dense_replace)."""
    cfg = _tiny_config("exaone_moe")
    out = config_overrides(cfg)
    assert out["is_moe_layer"] == [t != "dense" for t in cfg["mlp_layer_types"]]


# ---- exact activations (yeto.mlx.activations) ------------------------------------------
def test_every_activation_is_transformers_formula():
    """Each ACTIVATIONS entry computes transformers' ACT2FN function to float32 rounding."""
    import mlx.core as mx
    import numpy as np
    import torch
    from transformers.activations import ACT2FN

    from yeto.mlx.activations import ACTIVATIONS, _function

    x = np.linspace(-12, 12, 2001, dtype=np.float32)
    for name, mlx_name in ACTIVATIONS.items():
        want = ACT2FN[name](torch.from_numpy(x)).numpy()
        got = np.array(_function(mlx_name)(mx.array(x)))
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), name


def test_activation_sites_name_one_hard_coded_call():
    """Every site in the table exists in mlx-lm and calls exactly one known activation."""
    import importlib
    import inspect

    from yeto.mlx.activations import ACTIVATION_SITES, called

    for kind, (_, classes) in ACTIVATION_SITES.items():
        module = importlib.import_module(f"mlx_lm.models.{kind}")
        found = {n: c for m in (module, *[v for v in vars(module).values()
                                          if inspect.ismodule(v) and "mlx_lm" in v.__name__])
                 for n, c in vars(m).items() if inspect.isclass(c)}
        for name in classes:
            assert name in found, f"{kind}: no class {name} in mlx-lm"
            assert called(found[name]) is not None, f"{kind}.{name}"


def _mlx_model(arch: str, **overrides):
    from yeto.mlx.load import model_classes

    cfg = _tiny_config(arch, **overrides)
    cfg = {**cfg, **config_overrides(cfg)}
    build, args_cls = model_classes(cfg)
    return build(args_cls.from_dict(cfg))


@pytest.mark.parametrize("arch,act,expected", [
    ("gemma", "gelu_pytorch_tanh", "gelu_approx"),   # mlx-lm: exact gelu
    ("gpt_neox", "gelu", "gelu"),                    # mlx-lm: the tanh form
    ("llama", "gelu", "gelu"),                       # mlx-lm: swiglu (silu gate)
])
def test_the_config_activation_is_what_the_mlp_computes(arch, act, expected):
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    model = _mlx_model(arch, hidden_act=act)
    mlp = next(m for _, m in model.named_modules() if type(m).__name__ == "MLP")
    x = mx.random.normal((2, 3, archs.TINY["hidden_size"]), key=mx.random.key(0))
    fn = getattr(nn, expected)
    if arch == "gpt_neox":
        want = mlp.dense_4h_to_h(fn(mlp.dense_h_to_4h(x)))
    else:
        want = mlp.down_proj(fn(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert np.allclose(np.array(mlp(x)), np.array(want), rtol=1e-6, atol=1e-7)


def test_an_activation_mlx_cannot_compute_is_refused_by_name():
    from yeto.mlx.activations import ActivationError

    with pytest.raises(ActivationError, match=r"hidden_act='xielu'"):
        _mlx_model("llama", hidden_act="xielu")


# ---- configs other than the presets ------------------------------------------------------
def test_one_kind_of_layer_only():
    """exaone4 with no sliding layer: no pattern (mlx-lm looks for an "L" in any)."""
    cfg = _tiny_config("exaone4", layer_types=["full_attention"] * 6)
    assert config_overrides(cfg)["sliding_window_pattern"] is None
    model = _mlx_model("exaone4", layer_types=["full_attention"] * 6)
    assert model.model.swa_idx is None


def test_gemma3n_with_one_kind_of_layer_only():
    """gemma3n.py looks up the first sliding layer among those that own a cache: full
    layers only build, with a cache of their kind per layer (none shared); a layer that
    shares the cache of its kind is still refused by name."""
    from yeto.mlx.errors import UnsupportedConfig

    text = {"num_hidden_layers": 3, "layer_types": ["full_attention"] * 3,
            "intermediate_size": [128] * 3, "activation_sparsity_pattern": [0.0] * 3}
    model = _mlx_model("gemma3n", text_config=text)
    lm = model.model.language_model
    assert lm.first_kv_shared_layer_idx == 3 and not any(
        x.self_attn.is_kv_shared_layer for x in lm.layers)
    assert [type(c).__name__ for c in model.make_cache()] == ["KVCache"] * 3
    with pytest.raises(UnsupportedConfig, match="only 'full_attention' layers"):
        _mlx_model("gemma3n", text_config={**text, "num_kv_shared_layers": 1})


def test_llama4_layers_follow_the_config(tmp_path):
    """mlx-lm's llama4.py hard-codes RoPE + chunked attention in all layers but each 4th;
    the built model follows no_rope_layers and layer_types (any count); a kind Llama 4
    does not have is refused by name."""
    from mlx_lm.utils import load_config

    from yeto.mlx.errors import UnsupportedConfig
    from yeto.mlx.load import model_classes

    text = {"num_hidden_layers": 3, "no_rope_layers": [0, 1, 1], "moe_layers": [1],
            "layer_types": ["full_attention", "chunked_attention", "full_attention"]}
    # the text model's config, as archs.tiny_model writes it (model_type llama4_text)
    archs.tiny_config("llama4", {"text_config": text}).text_config.save_pretrained(tmp_path)
    cfg = load_config(tmp_path)
    cfg = {**cfg, **config_overrides(cfg)}
    build, args_cls = model_classes(cfg)
    model = build(args_cls.from_dict(cfg))
    assert [x.self_attn.use_rope for x in model.layers] == [0, 1, 1]
    assert [type(c).__name__ for c in model.make_cache()] == ["KVCache", "ChunkedKVCache",
                                                              "KVCache"]
    with pytest.raises(UnsupportedConfig, match=r"layer_types=.*'sliding_attention'"):
        config_overrides(_tiny_config("llama4", text_config={
            **text, "layer_types": ["sliding_attention"] * 3}))


def test_layer_patterns_are_fitted_or_built_layer_by_layer():
    lin, full = "linear_attention", "full_attention"
    cfg = _tiny_config("qwen3_next", layer_types=[lin, lin, full, lin, lin, full])
    assert config_overrides(cfg)["full_attention_interval"] == 3
    for types in ([lin] * 6, [full, lin, lin, lin, lin, full]):  # one kind; no period
        cfg = _tiny_config("qwen3_next", layer_types=types)
        out = config_overrides(cfg)
        assert out["yeto_layer_kinds"] == {"full_attention_interval": [t == full for t in types]}
        model = _mlx_model("qwen3_next", layer_types=types)
        assert [not x.is_linear for x in model.layers] == [t == full for t in types]
        assert model.model.fa_idx == (0 if full in types else None)


def test_mlp_width_not_a_multiple_of_the_hidden_size():
    """mlx-lm's gpt_neox.py builds the MLP 4 x hidden; the config's width is built."""
    model = _mlx_model("gpt_neox", intermediate_size=72)
    assert model.model.h[0].mlp.dense_h_to_4h.weight.shape == (72, 64)


@pytest.mark.parametrize("arch,more,rotated", [
    ("mixtral", {}, 32), ("cohere2", {}, 32), ("exaone", {}, 32),
    ("recurrent_gemma", {"num_key_value_heads": 2}, 16),  # partial_rotary_factor 0.5
])
def test_heads_as_wide_as_the_config_says(arch, more, rotated):
    """4 heads x head_dim 32 != hidden 64: mlx-lm's mixtral.py builds hidden // heads per
    head, cohere2.py refuses to build, exaone.py reshapes the output to hidden_size,
    recurrent_gemma.py both and one key/value head; yeto.mlx.heads gives every attention
    the config's widths."""
    import mlx.core as mx

    model = _mlx_model(arch, head_dim=32, **more)
    attns = [m for _, m in model.named_modules() if "q_proj" in m and hasattr(m, "head_dim")]
    assert attns
    for attn in attns:
        out_proj = attn["o_proj"] if "o_proj" in attn else attn["out_proj"]
        assert attn.head_dim == 32 and attn.scale == pytest.approx(32 ** -0.5)
        assert attn.q_proj.weight.shape == (4 * 32, 64)
        assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (2 * 32, 64)
        assert out_proj.weight.shape == (64, 4 * 32)
        assert attn.rope.dims == rotated
    x = mx.random.normal((1, 3, 64), key=mx.random.key(0))
    assert attns[0](x).shape == (1, 3, 64)  # exaone.py's, recurrent_gemma.py's reshapes raise


def test_a_config_without_head_dim_gets_the_one_transformers_builds():
    """InternLM3Config's head_dim defaults to 128 whatever hidden_size // heads is."""
    cfg = _tiny_config("internlm3")
    cfg.pop("head_dim")
    assert config_overrides(cfg)["head_dim"] == 128


def test_a_head_width_mlx_lm_cannot_hold_is_refused_by_name():
    """mlx-lm's cohere2.py builds only heads x head_dim = hidden_size; yeto builds it
    hidden // heads wide first and widens it, which needs hidden to be a multiple."""
    from yeto.mlx.errors import UnsupportedConfig

    with pytest.raises(UnsupportedConfig, match=r"head_dim=16: mlx-lm's cohere2.py builds "
                                                r"its attention only where"):
        _mlx_model("cohere2", num_attention_heads=3, num_key_value_heads=1)


def test_rope_scaling_reaches_a_plain_rope_module():
    """mlx-lm's gemma.py builds nn.RoPE whatever the scaling; llama3 and longrope replace it."""
    from mlx_lm.models.rope_utils import Llama3RoPE

    from yeto.mlx.rope import LongRoPE

    rope = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model = _mlx_model("gemma", rope_parameters=rope)
    assert isinstance(model.model.layers[0].self_attn.rope, Llama3RoPE)
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}
    model = _mlx_model("gemma", rope_parameters=rope)
    assert isinstance(model.model.layers[0].self_attn.rope, LongRoPE)


_LLAMA3 = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_rope_a_file_cannot_apply_is_replaced_after_building():
    """qwen2_moe.py refuses llama3 (built without it, then replaced); deepseek_v2.py's own
    yarn-only class becomes llama3 over the MLA rope part, interleaved as transformers'."""
    import mlx.nn as nn
    from mlx_lm.models.rope_utils import Llama3RoPE

    model = _mlx_model("qwen2_moe", rope_parameters=_LLAMA3)
    assert isinstance(model.model.layers[0].self_attn.rope, Llama3RoPE)
    model = _mlx_model("deepseek_v2", rope_parameters=_LLAMA3)
    rope = model.model.layers[0].self_attn.rope
    assert isinstance(rope, Llama3RoPE) and rope.traditional and rope.dims == 16
    # no scaling: deepseek_v2.py reads keys of rope_scaling even then (built neutral)
    model = _mlx_model("deepseek_v2", rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    rope = model.model.layers[0].self_attn.rope
    assert type(rope) is nn.RoPE and rope.traditional and rope.dims == 16 and rope.scale == 1.0


def test_longrope_keeps_the_pair_layout_its_file_asked_for():
    """mlx-lm's longrope class drops ``traditional``: deepseek_v3.py asks for interleaved
    pairs (as transformers' DeepSeek-V3 rotates), so yeto's longrope replacing it rotates
    neighbours, not halves (before: seed-1 variants with longrope off by 0.4)."""
    from yeto.mlx.rope import LongRoPE

    longrope = {"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 64,
                "short_factor": [1.0 + 0.05 * i for i in range(8)],
                "long_factor": [1.5 + 0.1 * i for i in range(8)]}
    model = _mlx_model("deepseek_v3", rope_parameters=longrope)
    rope = model.model.layers[0].self_attn.rope
    assert isinstance(rope, LongRoPE) and rope.traditional and rope.dims == 16
    import mlx_lm.models.deepseek_v3 as file
    from mlx_lm.models import rope_utils
    assert file.initialize_rope is rope_utils.initialize_rope  # put back after the build


def test_a_rotary_function_is_rebound_turning_the_same_way():
    """nanochat.py rotates with a function and negated frequencies (transformers' NanoChat
    turns the other way too): `Reversed` on reflections equals that; the attention calls
    the config's RoPE."""
    import mlx.core as mx
    import mlx.nn as nn

    from yeto.mlx.rebind import call_code
    from yeto.mlx.rope_files import Reversed

    x = mx.random.normal((1, 2, 5, 8), key=mx.random.key(0))
    periods = 1e4 ** (mx.arange(0, 8, 2, dtype=mx.float32) / 8)
    negated = mx.fast.rope(x, 8, traditional=False, base=None, scale=1.0, offset=3,
                           freqs=-periods)
    assert mx.allclose(Reversed(nn.RoPE(8), 8)(x, offset=3), negated, atol=1e-6).item()
    assert not mx.allclose(nn.RoPE(8)(x, offset=3), negated, atol=1e-3).item()
    model = _mlx_model("nanochat", rope_parameters=_LLAMA3)
    attn = model.transformer.h[0].attn
    assert "apply_rotary_emb" in call_code(type(attn)).co_names
    rotary = type(attn).__call__.__globals__["apply_rotary_emb"]
    assert isinstance(rotary.__defaults__[-1], Reversed)
    assert type(rotary.__defaults__[-1].rope).__name__ == "Llama3RoPE"


def test_a_rope_type_yeto_cannot_rotate_with_is_refused_by_name():
    from yeto.mlx.errors import UnsupportedConfig
    from yeto.mlx.rope import exact_rope

    with pytest.raises(UnsupportedConfig, match=r"rope_parameters.rope_type='mrope'"):
        exact_rope(8, 1e4, False, {"rope_type": "mrope", "mrope_section": [1, 1, 2]}, 64)


_LONG = {"short_factor": [1.0 + 0.05 * i for i in range(8)],
         "long_factor": [1.5 + 0.1 * i for i in range(8)]}


@pytest.mark.parametrize("length", [6, 48])  # within the original 8 positions; past 32
@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn", "yarn-mscale_all_dim",
                                  "llama3", "longrope"])
def test_exact_rope_is_transformers_rotary(kind, length):
    """`exact_rope` against transformers' LlamaRotaryEmbedding (its inverse frequencies,
    attention factor, longrope's switch to long_factor, dynamic's growth) at lengths
    within and past the original and the maximum positions."""
    import mlx.core as mx
    import numpy as np

    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as llama

    from yeto.mlx.rope import exact_rope

    params = {"rope_type": kind, "rope_theta": 1e4, "factor": 2.0,
              "original_max_position_embeddings": 8, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, **(_LONG if kind == "longrope" else {})}
    if kind == "longrope":
        del params["factor"]  # max / original positions: attention factor above 1
    if kind == "yarn-mscale_all_dim":  # attention factor mscale(factor): mlx-lm's is 1
        params.update(rope_type="yarn", mscale_all_dim=1.0)
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                      max_position_embeddings=32, rope_parameters=params)
    x = np.random.default_rng(0).standard_normal((1, 1, length, 16)).astype(np.float32)
    cos, sin = llama.LlamaRotaryEmbedding(cfg)(torch.from_numpy(x), torch.arange(length)[None])
    want = llama.apply_rotary_pos_emb(torch.from_numpy(x), torch.from_numpy(x), cos, sin)[0]
    got = exact_rope(16, 1e4, False, params, 32)(mx.array(x))
    np.testing.assert_allclose(np.array(got), want.numpy(), rtol=1e-4, atol=1e-4)


def test_minicpm3_values_and_tied_head_as_transformers_builds_them():
    """mlx-lm's minicpm3.py makes values hidden / heads wide (here 8, the config says 16)
    and skips the division by hidden_size / dim_model_base before a tied head
    (yeto.mlx.models.minicpm3)."""
    model = _mlx_model("minicpm3", hidden_size=64, num_attention_heads=8,
                       tie_word_embeddings=True)
    attn = model.model.layers[0].self_attn
    assert attn.o_proj.weight.shape == (64, 8 * 16)
    assert model.model.norm._yeto_divisor == 64 / 256


def test_kimi_linear_head_is_never_tied():
    """transformers' Kimi-Linear reads lm_head.weight whatever tie_word_embeddings says;
    mlx-lm's kimi_linear.py would take the embedding for it."""
    cfg = _tiny_config("kimi_linear", tie_word_embeddings=True)
    assert config_overrides(cfg)["tie_word_embeddings"] is False


def test_longrope_layout_survives_layers_built_again():
    """Layers yeto builds again for the config's MLP plan (glm_moe_dsa's
    ``mlp_layer_types``, `yeto.mlx.layer_kinds`) record their rotaries' layout too: the
    rebuilt layers rotate interleaved pairs as transformers' GLM-MoE-DSA does (before: seed-1
    and seed-2 variants with longrope off by 5e-3, 0.9 with the adapter)."""
    from yeto.mlx.rope import LongRoPE

    longrope = {"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 64,
                "short_factor": [1.0 + 0.05 * i for i in range(8)],
                "long_factor": [1.5 + 0.1 * i for i in range(8)]}
    model = _mlx_model("glm_moe_dsa", rope_parameters=longrope, num_hidden_layers=3,
                       mlp_layer_types=["dense", "sparse", "dense"])  # no period gives it
    for layer in model.model.layers:
        rope = layer.self_attn.rope
        assert isinstance(rope, LongRoPE) and rope.traditional and rope.dims == 16
        assert layer.self_attn.indexer.rope.traditional  # indexer_rope_interleave


@pytest.mark.parametrize("arch", ["longcat_flash", "kimi_linear", "minicpm3", "glm4_moe_lite"])
def test_mla_latent_norms_use_transformers_eps(arch):
    """transformers' MLA normalises its latents (q_a_layernorm, kv_a_layernorm) with eps
    1e-6; these mlx-lm files with nn.RMSNorm's default 1e-5 or the config's rms_norm_eps
    (before: base logits apart by 1e-5 to 1e-4 x max |logit|; longcat_flash's seed-2
    variant #2 over the bound)."""
    from transformers import AutoModelForCausalLM

    torch_model = AutoModelForCausalLM.from_config(archs.tiny_config(arch, None))
    want = {(n.rsplit(".", 1)[-1], m.variance_epsilon) for n, m in torch_model.named_modules()
            if n.endswith(("q_a_layernorm", "kv_a_layernorm"))}
    got = {(p.rsplit(".", 1)[-1], m.eps) for p, m in _mlx_model(arch).named_modules()
           if p.endswith(("q_a_layernorm", "kv_a_layernorm"))}
    assert want and got == want


def test_afmoe_with_sliding_layers_only(tmp_path):
    """afmoe.py looks up the first full-attention layer and builds one layer per
    layer_types entry: the full one appended for the lookup builds a layer past the last,
    which is dropped (before: refused naming layer_types). The model has the config's
    layers, all sliding, and computes transformers' logits with a window (4) shorter
    than the 16 tokens checked."""
    from yeto.interop import parity

    sliding = {"num_hidden_layers": 3, "layer_types": ["sliding_attention"] * 3,
               "sliding_window": 4}
    model = _mlx_model("afmoe", **sliding)
    assert [layer.use_sliding for layer in model.layers] == [True] * 3
    assert [type(c).__name__ for c in model.make_cache()] == ["RotatingKVCache"] * 3
    rep = parity.check(archs.tiny_model("afmoe", tmp_path / "afmoe", overrides=sliding),
                       r=4, alpha=8.0)
    assert rep.names_ok and rep.adapter_effect > 0.1
    assert rep.logits_ok(), (rep.max_dlogit, rep.max_logit, rep.base_dlogit, rep.notes)
