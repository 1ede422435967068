"""torch island vs MLX island on architectures other than the llama-style fixtures:
the config translation mlx-lm needs (yeto.mlx.shims), names and logits with the same
adapter (yeto.interop.parity), scripts/check_name_parity.py's last line, and (slow)
the whole architecture sweep."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'yeto[mlx]')")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'yeto[mlx]')")

from yeto.interop import parity  # noqa: E402
from yeto.mlx.shims import config_overrides  # noqa: E402
from yeto.testing import archs  # noqa: E402

pytestmark = pytest.mark.mlx

ROOT = Path(__file__).resolve().parents[1]
FAST = ["llama", "lfm2", "qwen3_moe", "gpt2", "gemma2"]


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


def _script(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "check_name_parity.py"),
                           *map(str, args)], capture_output=True, text=True, cwd=ROOT)


def test_check_name_parity_script(tmp_path):
    d = archs.tiny_model("qwen3_moe", tmp_path / "m")
    ok = _script("--model", d, "--lora-r", "4")
    last = ok.stdout.strip().splitlines()[-1]
    assert ok.returncode == 0, ok.stdout + ok.stderr
    m = re.fullmatch(r"parity: OK, (\d+) tensors, max \|dlogit\| (\S+)", last)
    assert m and int(m[1]) == 2 * 4 * archs.TINY_LAYERS  # q, k, v, o (MoE: attention)
    assert float(m[2]) < 1e-4
    bad = _script("--model", tmp_path / "missing", "--quiet")
    assert bad.returncode == 2 and "not found" in bad.stdout


# ---- the sweep ------------------------------------------------------------------------
@pytest.mark.slow
def test_arch_sweep_meets_the_goal(tmp_path):
    """>= 90 % of the architectures in transformers and mlx-lm: names and logits agree."""
    out = tmp_path / "sweep.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "arch_sweep.py"), "--jobs", "2",
                          "--json", out], capture_output=True, text=True, cwd=ROOT, timeout=1800)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())
    ok = [r["arch"] for r in rows if r["status"] == "ok"]
    assert run.stdout.strip().splitlines()[-1] == f"RESULT ok={len(ok)} of {len(rows)}"
    assert len(rows) >= 60  # computed from the libraries, not a short hand list
    failed = "\n".join(f"{r['arch']}: {r['status']} {r['reason']}" for r in rows
                       if r["status"] != "ok")
    assert len(ok) >= 0.9 * len(rows), failed
