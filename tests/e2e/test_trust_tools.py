"""The trust boundary of the tools: what a user hands `yeto export` / `yeto convert`,
the syncer and the islands (adapters, TLS files, a state dir, an output dir) is
checked up front, and what is wrong is refused in one line that names the file,
with a non-zero exit and no traceback.

The CLIs run as subprocesses, as a user runs them. The adapters are built here with
the library's own writers (`save_peft_adapter`, `peft_adapter_config`): numpy only,
no model, so every test takes about a second (the island ones: torch's import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from yeto.interop.adapters import (
    MLX_CONFIG,
    MLX_WEIGHTS,
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    peft_adapter_config,
    peft_to_mlx,
    save_peft_adapter,
)

ROOT = Path(__file__).resolve().parents[2]
MODULES = [f"model.layers.{i}.self_attn.{m}" for i in (0, 1) for m in ("q_proj", "v_proj")]


def run_cli(*args, cwd=None) -> subprocess.CompletedProcess:
    """`python -m ARGS` in a fresh interpreter, as a user would run it."""
    return subprocess.run([sys.executable, "-m", *map(str, args)], cwd=cwd or ROOT,
                          capture_output=True, text=True, timeout=120)


def refused(p: subprocess.CompletedProcess, *names) -> str:
    """The error line of a refusal that names every one of `names`."""
    assert p.returncode != 0, p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    for name in names:
        assert str(name) in p.stderr, p.stderr
    return p.stderr


def base_model(tmp: Path) -> Path:
    """What a base model dir must hold for a conversion: config.json's block count."""
    model = tmp / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    return model


def peft_adapter(out: Path, r=2, modules=MODULES, targets=("q_proj", "v_proj"),
                 base="model", seed=0) -> Path:
    """A healthy peft adapter (lora_A (r, 8), lora_B (8, r), non-zero)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for m in modules:
        tensors[f"base_model.model.{m}.lora_A.weight"] = rng.standard_normal((r, 8), np.float32)
        tensors[f"base_model.model.{m}.lora_B.weight"] = rng.standard_normal((8, r), np.float32)
    return save_peft_adapter(out, tensors, peft_adapter_config(str(base), r, 2.0 * r,
                                                               list(targets)))


def edit_weights(path: Path, edit) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, str(path))


def _nan(t):
    name = sorted(t)[0]
    t[name] = t[name].copy()
    t[name][0, 0] = np.nan


# every way an adapter's files can be wrong, and a word the refusal must say
DAMAGE = {
    "truncated": (lambda d, w: w.write_bytes(b"garbage"), "not a readable safetensors"),
    "empty": (lambda d, w: w.write_bytes(b""), "not a readable safetensors"),
    "config-not-json": (lambda d, w: (d / PEFT_CONFIG).write_text("{r: 2"), "not a readable "
                                                                          "JSON"),
    "nan": (lambda d, w: edit_weights(w, _nan), "NaN or infinite"),
    "inf": (lambda d, w: edit_weights(w, lambda t: t.update(
        {k: np.full_like(v, np.inf) for k, v in t.items()})), "NaN or infinite"),
    "lonely-factor": (lambda d, w: edit_weights(w, lambda t: t.pop(sorted(t)[-1])), "but no "
                                                                                    "lora_"),
    "no-lora": (lambda d, w: save_file({"x": np.zeros(2, np.float32)}, str(w)),
                "no LoRA factors"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_export_refuses_a_damaged_final_adapter(tmp_path, damage):
    """The issue's case: a 7-byte final adapter was copied and reported exported."""
    final = peft_adapter(tmp_path / "run" / "final")
    spoil, words = DAMAGE[damage]
    spoil(final, final / PEFT_WEIGHTS)
    out = tmp_path / "out"
    for fmt in ("peft", "mlx"):
        p = run_cli("yeto", "export", "--state-dir", tmp_path / "run", "--out", out,
                    "--format", fmt)
        err = refused(p, words)
        assert str(final) in err and err.count("\n") == 1  # one line
        assert not out.exists()


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_convert_refuses_a_damaged_peft_adapter(tmp_path, damage):
    src = peft_adapter(tmp_path / "peft", base=base_model(tmp_path))
    spoil, words = DAMAGE[damage]
    spoil(src, src / PEFT_WEIGHTS)
    p = run_cli("yeto", "convert", src, tmp_path / "mlx", "--to", "mlx")
    err = refused(p, src, words)
    assert err.count("\n") == 1
    assert not (tmp_path / "mlx" / MLX_WEIGHTS).exists()


@pytest.mark.parametrize("damage", ["truncated", "nan", "lonely-factor", "rank"])
def test_convert_refuses_a_damaged_mlx_adapter(tmp_path, damage):
    model = base_model(tmp_path)
    src = peft_to_mlx(peft_adapter(tmp_path / "peft", base=model), tmp_path / "mlx")
    weights = src / MLX_WEIGHTS
    if damage == "rank":  # lora_parameters.rank says 4, the factors have rank 2
        cfg = json.loads((src / MLX_CONFIG).read_text())
        cfg["lora_parameters"]["rank"] = 4
        (src / MLX_CONFIG).write_text(json.dumps(cfg))
        words = "rank=4"
    else:
        spoil, words = DAMAGE[damage]
        spoil(src, weights)
    p = run_cli("yeto", "convert", src, tmp_path / "back", "--to", "peft",
                "--base-model", model)
    refused(p, weights, words)
    assert not (tmp_path / "back" / PEFT_WEIGHTS).exists()


@pytest.mark.parametrize("case", ["rank", "targets", "shapes"])
def test_export_refuses_factors_that_disagree_with_the_config(tmp_path, case):
    final = tmp_path / "run" / "final"
    if case == "rank":  # the config says r=2, the tensors have rank 3
        peft_adapter(final, r=3)
        cfg = json.loads((final / PEFT_CONFIG).read_text())
        (final / PEFT_CONFIG).write_text(json.dumps(dict(cfg, r=2)))
        words = "r=2"
    elif case == "targets":  # LoRA on o_proj, which target_modules does not name
        peft_adapter(final, modules=[*MODULES, "model.layers.1.self_attn.o_proj"])
        words = "o_proj"
    else:  # lora_B of rank 5 beside lora_A of rank 2
        peft_adapter(final)
        edit_weights(final / PEFT_WEIGHTS, lambda t: t.update(
            {k: np.zeros((8, 5), np.float32) for k in t if k.endswith("lora_B.weight")}))
        words = "do not share one rank"
    p = run_cli("yeto", "export", "--state-dir", tmp_path / "run", "--out", tmp_path / "o")
    refused(p, final / PEFT_WEIGHTS, words)


def test_export_and_convert_do_not_overwrite_without_force(tmp_path):
    """A non-empty output dir is refused (naming it and --force); with --force the
    new adapter replaces the old one (the other format's weights go, other files stay)."""
    model = base_model(tmp_path)
    final = peft_adapter(tmp_path / "run" / "final", base=model, seed=1)
    old = peft_adapter(tmp_path / "old", base=model)
    for out in (tmp_path / "exported", tmp_path / "converted"):
        peft_to_mlx(old, out)
        (out / "notes.txt").write_text("mine")
    before = (tmp_path / "exported" / MLX_WEIGHTS).read_bytes()

    out = tmp_path / "exported"
    export = ("yeto", "export", "--state-dir", tmp_path / "run", "--out", out)
    refused(run_cli(*export), out, "--force", "not empty")
    assert (out / MLX_WEIGHTS).read_bytes() == before  # untouched
    p = run_cli(*export, "--force")
    assert p.returncode == 0, p.stderr
    assert not (out / MLX_WEIGHTS).exists()  # a peft adapter alone: not an ambiguous dir
    assert (out / PEFT_WEIGHTS).read_bytes() == (final / PEFT_WEIGHTS).read_bytes()
    assert (out / "notes.txt").read_text() == "mine"

    out = tmp_path / "converted"
    convert = ("yeto", "convert", final, out, "--to", "mlx")
    refused(run_cli(*convert), out, "--force", "not empty")
    assert (out / MLX_WEIGHTS).read_bytes() == before
    p = run_cli(*convert, "--force")
    assert p.returncode == 0, p.stderr
    assert (out / MLX_WEIGHTS).read_bytes() != before
    assert (out / "notes.txt").read_text() == "mine"


# ---- TLS files ------------------------------------------------------------------------
NOT_PEM = b"\x30\x82\x01\x0a\x02\x82"  # what a DER file starts with


@pytest.fixture
def pem(tmp_path) -> dict[str, Path]:
    """Files that look like a certificate and a key (the checks read labels only)."""
    files = {"cert": tmp_path / "server.pem", "key": tmp_path / "server.key",
             "der": tmp_path / "server.der", "missing": tmp_path / "nowhere.pem"}
    files["cert"].write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    files["key"].write_text("-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n")
    files["der"].write_bytes(NOT_PEM)
    return files


@pytest.mark.parametrize("cert, key, ca, bad, words", [
    ("missing", "key", None, "missing", "no such file"),
    ("der", "key", None, "der", "not a PEM file"),
    ("cert", "der", None, "der", "not a PEM file"),
    ("cert", "missing", None, "missing", "no such file"),
    ("cert", "key", "der", "der", "not a PEM file"),
    ("key", "cert", None, "key", "swapped"),
])
def test_syncer_refuses_bad_tls_files(tmp_path, pem, cert, key, ca, bad, words):
    args = ["syncer", "--port", "0", "--state-dir", tmp_path / "state",
            "--tls-cert", pem[cert], "--tls-key", pem[key]]
    p = run_cli(*args, *(["--tls-ca", pem[ca]] if ca else []))
    refused(p, pem[bad], words)


def test_islands_and_status_refuse_bad_tls_files(tmp_path, pem):
    island = ("yeto.learner", "--model", tmp_path / "no-model", "--data", tmp_path / "no-data",
              "--syncer", "127.0.0.1:1", "--max-steps", "1")
    refused(run_cli(*island, "--tls-ca", pem["missing"]), pem["missing"], "no such file")
    refused(run_cli(*island, "--tls-ca", pem["cert"], "--tls-cert", pem["cert"],
                    "--tls-key", pem["der"]), pem["der"], "not a PEM file")
    status = ("yeto", "status", "127.0.0.1:1", "--timeout", "1")
    refused(run_cli(*status, "--tls-ca", pem["der"]), pem["der"], "not a PEM file")


# ---- the syncer's state dir -----------------------------------------------------------
def test_syncer_refuses_a_state_dir_it_cannot_create(tmp_path):
    (tmp_path / "file").write_text("not a dir")
    for state in (tmp_path / "file", tmp_path / "file" / "state"):
        refused(run_cli("syncer", "--port", "0", "--state-dir", state), state, "--state-dir")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only dirs")
def test_syncer_refuses_a_read_only_state_dir(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o500)
    try:
        refused(run_cli("syncer", "--port", "0", "--state-dir", state), state, "cannot be written")
    finally:
        state.chmod(0o700)


def test_rl_island_refuses_a_damaged_adapter(tmp_path):
    adapter = peft_adapter(tmp_path / "sft")
    (adapter / PEFT_WEIGHTS).write_bytes(b"garbage")
    p = run_cli("yeto.rl", "--model", tmp_path / "no-model", "--data", tmp_path / "no-data",
                "--rollout-url", "http://127.0.0.1:1/v1", "--adapter", adapter)
    refused(p, adapter / PEFT_WEIGHTS, "--adapter", "not a readable safetensors")
