"""torch island vs MLX island on architectures other than the llama-style fixtures:
the config translation mlx-lm needs (yeto.mlx.shims), names and logits with the same
adapter (yeto.interop.parity), scripts/check_name_parity.py's last line, and (slow)
the whole architecture sweep.

Here: the checks that need no process, server or training (the others:
tests/integration/test_arch_parity.py, tests/e2e/test_arch_parity.py)."""


import pytest

pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'yeto[mlx]')")


pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'yeto[mlx]')")


from yeto.mlx.shims import config_overrides  # noqa: E402
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
