"""LoRA target selection (`yeto.targets`), transformers' Conv1D in peft, and the
MLX island's mapping of mlx-lm module paths to Hugging Face module paths.

Here: the checks that need no process, server or training (the others:
tests/integration/test_targets.py)."""


from __future__ import annotations

import logging

import pytest

from yeto.targets import TargetError, is_attention, is_moe, select_experts, select_targets

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


GPT2 = dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=96)


#: tiny configs of real architectures (meta device: shapes only, no weights)
ARCHS = {
    "llama": SMALL,
    "gpt2": GPT2,
    "gpt_bigcode": GPT2,
    "gpt_neox": SMALL,
    "phi": SMALL,
    "starcoder2": SMALL,
    "lfm2": dict(SMALL, layer_types=["conv", "full_attention"]),
    "qwen3_moe": dict(SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "recurrent_gemma": dict(SMALL, num_hidden_layers=3, lru_width=32),
    "falcon_mamba": dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, state_size=4),
}


#: leaf names chosen by (attention, all-linear)
EXPECTED = {
    "llama": ({"q_proj", "k_proj", "v_proj", "o_proj"},
              {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
    "gpt2": ({"attn.c_attn", "attn.c_proj"},
             {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}),
    "gpt_bigcode": ({"attn.c_attn", "attn.c_proj"},
                    {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}),
    "gpt_neox": ({"query_key_value", "attention.dense"},
                 {"query_key_value", "attention.dense", "dense_h_to_4h", "dense_4h_to_h"}),
    "phi": ({"q_proj", "k_proj", "v_proj", "self_attn.dense"},
            {"q_proj", "k_proj", "v_proj", "self_attn.dense", "fc1", "fc2"}),
    "starcoder2": ({"q_proj", "k_proj", "v_proj", "o_proj"},
                   {"q_proj", "k_proj", "v_proj", "o_proj", "mlp.c_fc", "mlp.c_proj"}),
    "lfm2": ({"q_proj", "k_proj", "v_proj", "self_attn.out_proj"},
             {"q_proj", "k_proj", "v_proj", "self_attn.out_proj", "conv.in_proj",
              "conv.out_proj", "w1", "w2", "w3"}),
    # its experts are fused weights, not linears: all-linear's linears are attention
    # (the experts: yeto.targets.select_experts, tests/unit/test_moe_targets.py)
    "qwen3_moe": ({"q_proj", "k_proj", "v_proj", "o_proj"}, {"q_proj", "k_proj", "v_proj",
                                                             "o_proj"}),
    "recurrent_gemma": ({"q_proj", "k_proj", "v_proj", "o_proj"},
                        {"q_proj", "k_proj", "v_proj", "o_proj", "linear_x", "linear_y",
                         "linear_out", "gate_proj", "up_proj", "down_proj"}),
    # transformers' Mamba mixer reads x_proj/dt_proj/out_proj weights directly: only
    # in_proj goes through the module, so only it can get LoRA on a torch island
    "falcon_mamba": (set(), {"in_proj"}),
}


def _short(paths: list[str], wanted: set[str]) -> set[str]:
    """Each chosen path as the shortest of ``wanted``'s names it ends with (or its leaf)."""
    out = set()
    for p in paths:
        hits = sorted((w for w in wanted if p.endswith("." + w)), key=len, reverse=True)
        out.add(hits[0] if hits else p.rsplit(".", 1)[-1])
    return out


@pytest.fixture(scope="module")
def meta_models():
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    from yeto.torch.model import linear_paths

    out = {}
    for arch, kw in ARCHS.items():
        config = AutoConfig.for_model(arch, **kw)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        out[arch] = (linear_paths(model), config.to_dict())
    return out


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_selection_on_real_architectures(meta_models, arch):
    paths, config = meta_models[arch]
    attention, every = EXPECTED[arch]
    if attention:
        chosen = select_targets(paths, "attention", config)
        assert _short(chosen, attention) == attention
        assert all(".0." in p or ".1." in p or ".2." in p for p in chosen)  # in the blocks
    else:
        with pytest.raises(TargetError, match="no attention projections: try all-linear"):
            select_targets(paths, "attention", config)
    chosen = select_targets(paths, "all-linear", config)
    assert _short(chosen, every) == every
    assert not any(p.startswith("lm_head") or "embed" in p for p in chosen)
    auto = select_targets(paths, "auto", config)
    assert auto == chosen  # dense: auto = all-linear (qwen3_moe: attention, both)


def test_explicit_lists_match_like_peft(meta_models):
    paths, config = meta_models["gpt2"]
    assert [p.split(".h.")[1] for p in select_targets(paths, "c_attn", config)] == [
        "0.attn.c_attn", "1.attn.c_attn"]
    # a dotted entry matches a path suffix: attention's c_proj, not the MLP's
    chosen = select_targets(paths, "attn.c_proj, c_fc", config)
    assert sorted(p.split(".h.")[1] for p in chosen) == [
        "0.attn.c_proj", "0.mlp.c_fc", "1.attn.c_proj", "1.mlp.c_fc"]


def test_no_match_error_names_the_flag_and_the_linears(meta_models):
    paths, config = meta_models["gpt_neox"]
    with pytest.raises(TargetError) as e:
        select_targets(paths, "q_proj,v_proj", config)
    msg = str(e.value)
    assert "--lora-targets 'q_proj,v_proj' matched no linear layer" in msg
    assert "dense, dense_4h_to_h, dense_h_to_4h, query_key_value" in msg  # leaves, deduplicated
    assert "gpt_neox.layers.0.attention.dense" in msg  # a full path as an example
    assert "e.g. --lora-targets dense,dense_4h_to_h" in msg
    with pytest.raises(TargetError, match="no linear layers at all"):
        select_targets([], "auto", {})


def test_no_match_from_the_torch_island(meta_models):
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from transformers import AutoConfig, AutoModelForCausalLM

    from yeto.torch.model import attach_lora

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **SMALL))
    with pytest.raises(TargetError, match=r"--lora-targets 'wq'.*down_proj, gate_proj, k_proj"):
        attach_lora(model, 4, 8.0, "wq", 0)


def test_moe_policy(meta_models, caplog):
    paths, config = meta_models["qwen3_moe"]
    assert is_moe(config)
    with caplog.at_level(logging.INFO, logger="yeto.targets"):
        chosen = select_targets(paths, "auto", config)
    assert chosen == select_targets(paths, "attention", config)
    line = " ".join(r.getMessage() for r in caplog.records)
    assert "mixture-of-experts model: --lora-targets auto adapts attention only" in line
    assert "--lora-targets all-linear" in line
    with pytest.raises(TargetError) as e:  # experts asked for, none that both islands adapt
        select_experts([], "all-linear", config, paths)
    assert "mixture-of-experts" in str(e.value) and "--lora-targets attention" in str(e.value)


def test_per_expert_linears_are_adapted_but_not_their_router():
    blocks = [f"model.layers.{i}.{m}" for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.o_proj", "mlp.gate", "mlp.shared_expert.up_proj",
        "mlp.experts.0.w1", "mlp.experts.1.w1")]
    paths = [*blocks, "lm_head"]
    assert is_moe({}, paths) and not is_moe({"num_experts": 1, "n_shared_experts": 1})
    every = select_targets(paths, "all-linear", {})
    assert "model.layers.0.mlp.experts.1.w1" in every and "model.layers.0.mlp.gate" not in every
    assert "model.layers.1.mlp.shared_expert.up_proj" in every and "lm_head" not in every
    assert select_targets(paths, "auto", {}) == sorted(p for p in blocks if "self_attn" in p)
    # a plain entry never picks an expert, one that names the experts does
    assert not any("experts" in p for p in select_targets(paths, "w1,q_proj", {}))
    assert len(select_targets(paths, "experts.0.w1", {})) == 2


def test_attention_scope():
    assert is_attention("model.layers.3.self_attn.out_proj")
    assert is_attention("transformer.blocks.0.norm_attn_norm.attn.Wqkv")
    assert is_attention("model.layers.0.mixer.q_proj")  # nemotron_h: attention as a "mixer"
    assert not is_attention("model.layers.0.mixer.in_proj")  # its mamba mixer
    assert not is_attention("model.layers.0.conv.out_proj")
    assert not is_attention("lm_head")


def test_peft_keeps_module_targets_on_moe_models():
    """peft's transformers-4 rewrite of MoE targets (``*gate_proj`` -> the fused
    experts' ``gate_up_proj``) must not touch yeto's module paths."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from transformers import AutoConfig, AutoModelForCausalLM

    from yeto.torch.model import attach_lora

    config = AutoConfig.for_model("qwen2_moe", **SMALL, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=16, shared_expert_intermediate_size=16)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model = attach_lora(model, 4, 8.0, "q_proj,shared_expert.gate_proj", 0)
    adapted = sorted({n.split(".lora_A")[0].split(".layers.1.")[-1] for n, _ in
                      model.named_parameters() if ".lora_A." in n and ".layers.1." in n})
    assert adapted == ["mlp.shared_expert.gate_proj", "self_attn.q_proj"]
    assert not model.peft_config["default"].target_parameters


def test_multimodal_towers_are_not_targets():
    paths = [f"model.{t}.layers.{i}.{m}" for t in ("language_model", "vision_tower.encoder")
             for i in range(2) for m in ("self_attn.q_proj", "mlp.fc1")]
    paths += ["model.multi_modal_projector.layers.0.linear", "model.audio_tower.layers.0.q_proj"]
    assert select_targets(paths, "all-linear", {}) == [
        f"model.language_model.layers.{i}.{m}" for i in range(2)
        for m in ("mlp.fc1", "self_attn.q_proj")]


def test_auto_on_a_moe_without_attention_adapts_its_non_expert_linears(caplog):
    paths = [f"model.layers.{i}.{m}" for i in range(2) for m in (
        "mamba.in_proj", "mamba.out_proj", "shared_mlp.input_linear", "shared_mlp.output_linear")]
    config = {"model_type": "granitemoehybrid", "num_local_experts": 4}
    with caplog.at_level(logging.INFO, logger="yeto.targets"):
        chosen = select_targets(paths, "auto", config)
    assert chosen == sorted(p for p in paths if not p.endswith("out_proj"))  # Mamba out_proj
    assert "its linears that are not experts" in caplog.text and "out_proj not adapted" in \
        caplog.text
    with pytest.raises(TargetError, match="no attention projections: try all-linear"):
        select_targets(paths, "attention", config)
