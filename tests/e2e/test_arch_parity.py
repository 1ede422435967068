"""torch island vs MLX island on architectures other than the llama-style fixtures:
the config translation mlx-lm needs (yeto.mlx.config), names and logits with the same
adapter (yeto.interop.parity), `yeto check-parity`'s last line, and (slow)
the whole architecture sweep.

Here: the checks that need real processes (the others: tests/unit/test_arch_parity.py,
tests/integration/test_arch_parity.py)."""


import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'yeto[mlx]')")


pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'yeto[mlx]')")


from yeto.testing import archs  # noqa: E402

pytestmark = pytest.mark.mlx


ROOT = Path(__file__).resolve().parents[2]


YETO = Path(sys.executable).parent / "yeto"  # the console command `pip install yeto` writes


def _check_parity(*args, command=(sys.executable, "-m", "yeto")):
    return subprocess.run([*command, "check-parity", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT)


def test_check_parity_help_through_the_installed_command():
    r = _check_parity("--help", command=(str(YETO),))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: yeto check-parity") and "--lora-targets" in r.stdout
    r = subprocess.run([str(YETO), "--help"], capture_output=True, text=True)
    assert "check-parity" in r.stdout


def test_check_parity(tmp_path):
    d = archs.tiny_model("qwen3_moe", tmp_path / "m")
    ok = _check_parity("--model", d, "--lora-r", "4")
    last = ok.stdout.strip().splitlines()[-1]
    assert ok.returncode == 0, ok.stdout + ok.stderr
    m = re.fullmatch(r"parity: OK, (\d+) tensors, max \|dlogit\| (\S+)", last)
    assert m and int(m[1]) == 2 * 4 * archs.TINY_LAYERS  # q, k, v, o (MoE: attention)
    assert float(m[2]) < 1e-4
    bad = _check_parity("--model", tmp_path / "missing", "--quiet")
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
    counted = [r for r in rows if not r.get("not_shared")]
    assert run.stdout.strip().splitlines()[-1] == f"RESULT ok={len(ok)} of {len(counted)}"
    assert len(rows) >= 60  # computed from the libraries, not a short hand list
    failed = "\n".join(f"{r['arch']}: {r['status']} {r['reason']}" for r in rows
                       if r["status"] != "ok")
    assert len(ok) >= 0.9 * len(rows), failed


@pytest.mark.slow
def test_arch_sweep_variants_fail_only_outside_yeto(tmp_path):
    """Three drawn configs per architecture (--variants 3 --seed 0): every failure is
    mlx-lm's or transformers' (a refused config names its field), none yeto's."""
    out = tmp_path / "variants.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "arch_sweep.py"), "--jobs", "2",
                          "--variants", "3", "--seed", "0", "--json", out],
                         capture_output=True, text=True, cwd=ROOT, timeout=3600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 3 * len({r["arch"] for r in rows})
    ours = [f"{r['arch']}#{r['variant']}: {r['status']} {r['reason']}" for r in rows
            if r["status"] not in ("ok", "mlx-lm", "transformers")]
    assert not ours, "\n".join(ours)


# heads x head_dim != hidden_size (4 x 32 != 64): mlx-lm's mixtral.py and recurrent_gemma.py
# build hidden // heads per head, cohere2.py refuses, exaone.py reshapes the output to hidden
# (yeto.mlx.heads); recurrent_gemma.py also reshapes keys and values to one head, and its
# RoPE base is 10000 whatever rope_theta says
HEAD_WIDTHS = {
    "mixtral": {"head_dim": 32}, "cohere2": {"head_dim": 32}, "exaone": {"head_dim": 32},
    "recurrent_gemma": {"head_dim": 32, "num_key_value_heads": 2, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
}


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(HEAD_WIDTHS))
def test_heads_wider_than_hidden_agree(arch, tmp_path):
    from yeto.interop import parity

    d = archs.tiny_model(arch, tmp_path / arch, overrides=HEAD_WIDTHS[arch])
    rep = parity.check(d, r=4, alpha=8.0)
    assert rep.names_ok, rep.first_mismatch
    assert rep.adapter_effect > 0.1 * rep.max_logit  # cohere2's logits are scaled by 1/16
    assert rep.logits_ok(), (f"max |dlogit| {rep.max_dlogit:.3g}, max |logit| "
                             f"{rep.max_logit:.3g}, base {rep.base_dlogit:.3g}, {rep.notes}")


# ---- layer plans through the KV caches (mlx-lm's generation path) ----------------------
_PLANS = {
    # Llama 4: 3 layers, the middle one global without RoPE, chunks of 4 tokens
    "llama4": {"text_config": {"num_hidden_layers": 3, "no_rope_layers": [1, 0, 1],
                               "layer_types": ["chunked_attention", "full_attention",
                                               "chunked_attention"],
                               "attention_chunk_size": 4, "floor_scale": 4, "moe_layers": [1]}},
    # gemma3n with full-attention layers only
    "gemma3n": {"text_config": {"num_hidden_layers": 3, "layer_types": ["full_attention"] * 3,
                                "intermediate_size": [128] * 3,
                                "activation_sparsity_pattern": [0.0] * 3}},
}


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(_PLANS))
def test_layer_plans_decode_through_their_caches(arch, tmp_path):
    """A layer plan yeto builds (yeto.mlx.models.llama4, layer_kinds) decodes token by token
    through the model's own caches (make_cache: a cache of each layer's kind) to the
    logits of one forward pass over the whole sequence, past a chunk boundary."""
    import mlx.core as mx
    import numpy as np

    from yeto.mlx.load import load_model

    model, _ = load_model(archs.tiny_model(arch, tmp_path / arch, overrides=_PLANS[arch]))
    ids = mx.array([[3, 5, 7, 9, 11, 13, 15, 17, 19, 21]])
    whole = np.array(model(ids))
    cache = model.make_cache()
    steps = [np.array(model(ids[:, :6], cache=cache))[:, -1]]
    steps += [np.array(model(ids[:, t:t + 1], cache=cache))[:, -1] for t in range(6, 10)]
    assert np.allclose(np.stack(steps, 1), whole[:, 5:], atol=1e-5 * np.abs(whole).max())


@pytest.mark.slow
def test_llama4_plan_with_packed_documents(tmp_path):
    """A document-packed block (yeto.mlx.packing.MaskCache through every layer, chunked
    ones included): the first document's logits are those of it alone, and the second
    document does not see the first."""
    import mlx.core as mx
    import numpy as np

    from yeto.mlx.learner import document_mask, logits_of
    from yeto.mlx.load import load_model

    model, _ = load_model(archs.tiny_model("llama4", tmp_path / "m", overrides=_PLANS["llama4"]))
    ids = mx.array([[3, 5, 7, 9, 11, 13, 15, 17, 19, 21]])
    packed = np.array(logits_of(model, ids, document_mask(np.array([[0, 1, 2, 0, 1, 2, 3, 4, 5,
                                                                      6]]))))
    alone = np.array(model(ids[:, :3]))
    assert np.allclose(packed[:, :3], alone, atol=1e-6)
    assert not np.allclose(packed[:, 3:], np.array(model(ids))[:, 3:], atol=1e-3)


@pytest.mark.slow
def test_arch_sweep_variants_with_rope_types_their_files_cannot_apply(tmp_path):
    """The variants (--seed 0) whose RoPE type the mlx-lm file's own rotary or constructor
    could not apply (issue 32: MLA and own rotary classes, a rotary function, constructors
    that refuse the scaling) have the torch island's logits (yeto.mlx.rope_files)."""
    archs_ = "deepseek_v2,hunyuan_v1_dense,minicpm3,nanochat,qwen2_moe,nemotron,gpt_oss"
    out = tmp_path / "rope.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "arch_sweep.py"), "--jobs", "2",
                          "--variants", "3", "--seed", "0", "--only", archs_, "--json", out],
                         capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 21
    failed = [f"{r['arch']}#{r['variant']}: {r['status']} {r['reason']}" for r in rows
              if r["status"] != "ok"]
    assert not failed, "\n".join(failed)
