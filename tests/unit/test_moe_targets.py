"""LoRA targets on mixture-of-experts models whose experts are fused 3-D weights
(yeto.targets.select_experts, expert_lora_module, routers) and the adapter files
that carry them (peft's target_parameters; mlx-lm's LoRASwitchLinear factors)."""

import json

import numpy as np
import pytest

from yeto.interop.adapters import peft_adapter_config
from yeto.targets import (
    TargetError,
    expert_lora_module,
    experts_only,
    select_experts,
    select_targets,
)

MOE = {"model_type": "qwen3_moe", "num_experts": 4}
BLOCK = "model.layers.{}.{}"
LINEARS = [BLOCK.format(i, m) for i in (0, 1) for m in (
    "self_attn.q_proj", "self_attn.o_proj", "mlp.gate", "mlp.shared_expert.up_proj",
    "mlp.shared_expert_gate")]
FUSED = [BLOCK.format(i, f"mlp.experts.{p}") for i in (0, 1) for p in ("gate_up_proj",
                                                                       "down_proj")]


def test_all_linear_adapts_fused_experts_not_their_router():
    linears = select_targets(LINEARS, "all-linear", MOE, experts=FUSED)
    assert "model.layers.0.mlp.shared_expert.up_proj" in linears
    assert not any(p.endswith((".mlp.gate", ".shared_expert_gate")) for p in linears)
    assert select_experts(FUSED, "all-linear", MOE, LINEARS) == sorted(FUSED)
    for mode in ("auto", "attention"):  # auto stays attention-only on MoE
        assert select_experts(FUSED, mode, MOE, LINEARS) == []


@pytest.mark.parametrize("mode, want", [
    ("experts", FUSED),
    ("mlp.experts", FUSED),
    ("experts.down_proj", [p for p in FUSED if p.endswith("down_proj")]),
    ("q_proj,experts.gate_up_proj", [p for p in FUSED if p.endswith("gate_up_proj")]),
    ("q_proj", []),
])
def test_entries_naming_experts(mode, want):
    assert select_experts(FUSED, mode, MOE, LINEARS) == sorted(want)
    linears = select_targets(LINEARS, mode, MOE, experts=FUSED)
    assert linears == [p for p in sorted(LINEARS) if mode.startswith("q_proj")
                       and p.endswith("q_proj")]
    assert experts_only(mode) == ("q_proj" not in mode)


def test_experts_asked_for_where_there_are_none():
    with pytest.raises(TargetError, match="matched no expert weight.*all-linear"):
        select_experts([], "experts", MOE, LINEARS)
    with pytest.raises(TargetError, match="mixture-of-experts.*--lora-targets attention"):
        select_experts([], "all-linear", MOE, LINEARS)
    dense = [p for p in LINEARS if "mlp.gate" not in p]
    assert select_experts([], "all-linear", {"model_type": "llama"}, dense) == []


def test_expert_lora_module_is_peft_nesting():
    """peft wraps one weight per ParamWrapper, in registration order (gate_up_proj,
    then down_proj): the last is outermost, the earlier one a base_layer deeper."""
    gate_up, down = FUSED[0], FUSED[1]
    assert expert_lora_module(gate_up, FUSED) == "model.layers.0.mlp.experts.base_layer"
    assert expert_lora_module(down, FUSED) == "model.layers.0.mlp.experts"
    assert expert_lora_module(gate_up, [gate_up]) == "model.layers.0.mlp.experts"


def test_adapter_config_names_target_parameters():
    cfg = json.loads(peft_adapter_config("m", 4, 8.0, [], target_parameters=FUSED[::-1]))
    assert cfg["target_parameters"] == sorted(FUSED) and cfg["target_modules"] is None
    both = json.loads(peft_adapter_config("m", 4, 8.0, ["q_proj"], target_parameters=FUSED))
    assert both["target_modules"] == ["q_proj"]
    assert json.loads(peft_adapter_config("m", 4, 8.0, ["q_proj"]))["target_parameters"] is None


def test_mlx_lm_factors_are_peft_rows_per_expert():
    """peft: lora_A (r·E, in) is expert-major, lora_B (out, r·E) expert-minor; mlx-lm's
    LoRASwitchLinear holds per expert lora_b[e] @ lora_a[e] = rows of B_e·A_e."""
    pytest.importorskip("mlx.core", reason="mlx is not installed")
    from yeto.mlx.experts import Fused, Part, mlx_lm_factors, peft_factors

    n_exp, r, out, n_in = 3, 2, 6, 5
    rng = np.random.default_rng(0)
    a = rng.standard_normal((r * n_exp, n_in)).astype(np.float32)
    b = rng.standard_normal((out, r * n_exp)).astype(np.float32)
    up = np.tile(np.arange(3, 6, dtype=np.int32), (n_exp, 1))  # the up half of gate_up
    fused = Fused("m.experts.gate_up_proj", (n_exp, out, n_in), [Part("sw.up_proj", up)])
    lora_a, lora_b = mlx_lm_factors(a, b, fused)["sw.up_proj"]
    assert lora_a.shape == (n_exp, r, n_in) and lora_b.shape == (n_exp, 3, r)
    for e in range(n_exp):  # peft's get_delta_weight, written out
        delta = np.einsum("or,ri->oi", b.reshape(out, r, n_exp)[:, :, e],
                          a.reshape(n_exp, r, n_in)[e])
        np.testing.assert_allclose(lora_b[e] @ lora_a[e], delta[3:], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="do not fit 3 experts"):
        mlx_lm_factors(a[:5], b, fused)
    # and back (peft_factors), when the parts cover every row
    gate = Part("sw.gate_proj", np.tile(np.arange(3, dtype=np.int32), (n_exp, 1)))
    both = Fused(fused.param, fused.shape, [gate, *fused.parts])
    a2, b2 = peft_factors(mlx_lm_factors(a, b, both), both)
    assert np.array_equal(a2, a) and np.array_equal(b2, b)
    with pytest.raises(ValueError, match="do not cover"):
        peft_factors(mlx_lm_factors(a, b, fused), fused)
