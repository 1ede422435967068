"""torch island vs MLX island on architectures other than the llama-style fixtures:
the config translation mlx-lm needs (yeto.mlx.config), names and logits with the same
adapter (yeto.interop.parity), `yeto check-parity`'s last line, and (slow)
the whole architecture sweep.

Here: the checks through in-process servers, training or the sim (the others:
tests/unit/test_arch_parity.py, tests/e2e/test_arch_parity.py)."""


import json

import pytest

pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'yeto[mlx]')")


pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'yeto[mlx]')")


from yeto.interop import parity  # noqa: E402
from yeto.testing import archs  # noqa: E402

pytestmark = pytest.mark.mlx


# gemma: mlx-lm's gemma.py computes the exact GELU where the config names the tanh form
# (yeto.mlx.activations swaps it; without that, max |dlogit| is ~1e-3 x max |logit|)
FAST = ["llama", "lfm2", "qwen3_moe", "gpt2", "gemma2", "gemma"]


# ---- names and logits -----------------------------------------------------------------
@pytest.mark.parametrize("arch", FAST)
def test_names_and_logits_agree(arch, tmp_path):
    d = archs.tiny_model(arch, tmp_path / arch)
    rep = parity.check(d, r=4, alpha=8.0)
    assert rep.names_ok, rep.first_mismatch
    assert rep.n_tensors > 0
    assert rep.adapter_effect > 0.1  # the adapter matters, so its parity is tested
    assert rep.logits_ok(), (f"max |dlogit| {rep.max_dlogit:.3g}, max |logit| "
                             f"{rep.max_logit:.3g}, base {rep.base_dlogit:.3g}, {rep.notes}")


def test_truncated_copy_keeps_the_first_layers(tmp_path):
    d = archs.tiny_model("qwen3", tmp_path / "full")
    cut = parity.truncated_copy(d, 2, tmp_path / "cut")
    cfg = json.loads((cut / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and len(cfg["layer_types"]) == 2
    rep = parity.check(d, r=4, alpha=8.0, numeric_layers=2)
    assert rep.numeric_layers == 2 and rep.logits_ok()
    assert any("truncated" in n for n in rep.notes)
    # a hybrid keeps one layer of each kind: qwen3_5's first full-attention layer is 4th
    hybrid = archs.tiny_model("qwen3_5", tmp_path / "hybrid")
    cut = parity.truncated_copy(hybrid, 2, tmp_path / "hybrid-cut")
    cfg = json.loads((cut / "config.json").read_text())
    assert parity.layer_count(cfg) == 4 and cfg["layer_types"][-1] == "full_attention"


# ---- configs other than the presets (scripts/arch_sweep.py --variants draws many) -----------
_SLIDE, _FULL = "sliding_attention", "full_attention"
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
OTHER_CONFIGS = {
    # biases mlx-lm's gemma.py never builds, an untied head it always ties, llama3 RoPE on
    # a plain nn.RoPE
    "gemma": {"attention_bias": True, "tie_word_embeddings": False, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    # an MLP 72 wide, where mlx-lm's gpt_neox.py builds 4 x hidden
    "gpt_neox": {"intermediate_size": 72},
    # layer kinds with no period (mlx-lm's gemma3_text.py places them by one), hidden 48
    "gemma3_text": {"num_hidden_layers": 5, "hidden_size": 48,
                    "layer_types": [_SLIDE, _FULL, _FULL, _SLIDE, _FULL]},
    # attention layers only (mlx-lm's lfm2.py indexed a conv layer's cache: IndexError)
    "lfm2": {"num_hidden_layers": 3, "layer_types": [_FULL] * 3},
    # longrope (mlx-lm's SuScaledRoPE rotates with long_factor at any length)
    "qwen3": {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e6,
                                  "short_factor": [1.0 + 0.05 * i for i in range(8)],
                                  "long_factor": [1.5 + 0.1 * i for i in range(8)],
                                  "original_max_position_embeddings": 64}},
    # tied in the config, a head of its own in transformers' Kimi-Linear (which never ties),
    # where mlx-lm's kimi_linear.py ties
    "kimi_linear": {"tie_word_embeddings": True},
    # Llama 4's plan from the config (mlx-lm's llama4.py hard-codes RoPE and chunks in all
    # layers but each 4th, >= 4 layers): 3 layers, the middle one global without RoPE,
    # chunks of 4 tokens and temperature tuning from position 4 on (16 tokens checked)
    "llama4": {"text_config": {"num_hidden_layers": 3, "no_rope_layers": [1, 0, 1],
                               "layer_types": ["chunked_attention", _FULL, "chunked_attention"],
                               "attention_chunk_size": 4, "floor_scale": 4, "moe_layers": [1]}},
    # 4 heads x head_dim 32 != hidden 64, where mlx-lm's internlm3.py builds hidden // heads
    # per head (yeto.mlx.heads widens projections, scale and RoPE)
    "internlm3": {"head_dim": 32},
    # RoPE types the model file cannot apply (yeto.mlx.rope_files): llama3, which
    # mlx-lm's qwen2_moe.py refuses to construct; llama3 in deepseek_v2.py's own yarn-only
    # class (MLA, interleaved pairs); longrope in nanochat.py's rotary function, which
    # turns the other way
    "qwen2_moe": {"rope_parameters": {**_LLAMA3, "rope_theta": 1e4}},
    "deepseek_v2": {"rope_parameters": {**_LLAMA3, "rope_theta": 1e4}},
    "nanochat": {"rope_parameters": {
        "rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 64,
        "short_factor": [1.0 + 0.05 * i for i in range(8)],
        "long_factor": [1.5 + 0.1 * i for i in range(8)]}},
    # values v_head_dim (16) wide, not hidden / heads (8), and a tied head, which mlx-lm's
    # minicpm3.py builds otherwise (yeto.mlx.models.minicpm3)
    "minicpm3": {"hidden_size": 64, "num_attention_heads": 8, "tie_word_embeddings": True},
    # a head tied to the embedding with a bias of its own (transformers' lm_head.bias),
    # where mlx-lm's ernie4_5_moe.py computes the tied head without one (yeto.mlx.structure)
    "ernie4_5_moe": {"use_bias": True, "tie_word_embeddings": True},
}


# one config per mechanism runs by default; these run with the slow tier (each mechanism
# is also unit-tested in tests/unit/test_arch_parity.py: the MLP width, exact longrope, a
# refused constructor, MiniCPM3's values and tied head, Kimi-Linear's head)
SLOW_CONFIGS = {"gpt_neox", "qwen3", "qwen2_moe", "minicpm3", "kimi_linear"}


@pytest.mark.parametrize("arch", [pytest.param(a, marks=(pytest.mark.slow, pytest.mark.regimes))
                                  if a in SLOW_CONFIGS
                                  else a for a in sorted(OTHER_CONFIGS)])
def test_configs_other_than_the_presets(arch, tmp_path):
    d = archs.tiny_model(arch, tmp_path / arch, overrides=OTHER_CONFIGS[arch])
    rep = parity.check(d, r=4, alpha=8.0)
    assert rep.names_ok, rep.first_mismatch
    assert rep.adapter_effect > 0.1
    assert rep.logits_ok(), (f"max |dlogit| {rep.max_dlogit:.3g}, max |logit| "
                             f"{rep.max_logit:.3g}, base {rep.base_dlogit:.3g}, {rep.notes}")
