"""`yeto export` / `yeto convert`: every output loads with the real loader
(peft.PeftModel.from_pretrained, mlx_lm.load(..., adapter_path=...)) and computes
peft's logits; what cannot be converted exactly is refused with the reason.

Here: the checks through in-process servers, training or the sim (the others:
tests/unit/test_export.py, tests/e2e/test_export.py)."""


import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.syncer import running_syncer
from helpers.wait import wait_until
from safetensors.numpy import load_file

from yeto.interop.adapters import MLX_CONFIG, MLX_WEIGHTS, PEFT_CONFIG, PEFT_WEIGHTS
from yeto.interop.export import main_convert, main_export

TOL = 1e-4


IDS = np.random.default_rng(0).integers(3, 1000, (2, 24))


@pytest.fixture(scope="module")
def base(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    assert model.config.num_hidden_layers == 2
    with torch.no_grad():
        plain = model(input_ids=torch.from_numpy(IDS)).logits.numpy()
    return model, plain


def make_peft(out: Path, tiny_llama, seed=0, **lora) -> Path:
    """A peft adapter on the tiny model with non-zero B (so it changes the logits)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    cfg = dict(r=4, lora_alpha=12, target_modules=["q_proj", "v_proj", "down_proj"],
               init_lora_weights=False)
    cfg.update(lora)
    get_peft_model(model, LoraConfig(**cfg)).save_pretrained(out)
    return out


def peft_logits(base_model, adapter: Path) -> np.ndarray:
    import copy

    from peft import PeftModel

    model = PeftModel.from_pretrained(copy.deepcopy(base_model), str(adapter)).eval()
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(IDS)).logits.numpy()


def mlx_logits(tiny_llama, adapter: Path) -> np.ndarray:
    mx = pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    model, _ = mlx_lm.load(str(tiny_llama), adapter_path=str(adapter))
    model.set_dtype(mx.float32)
    return np.asarray(model(mx.array(IDS)).astype(mx.float32))


@pytest.mark.mlx
@pytest.mark.parametrize("layers", [None, [1]], ids=["all-layers", "last-layer-only"])
def test_convert_both_ways_loads_with_the_real_loaders(tmp_path, tiny_llama, base, layers,
                                                       capsys):
    model, plain = base
    peft_dir = make_peft(tmp_path / "peft", tiny_llama, layers_to_transform=layers)
    want = peft_logits(model, peft_dir)
    assert np.abs(want - plain).max() > 1e-2  # the adapter does change the function

    assert main_convert([str(peft_dir), str(tmp_path / "mlx"), "--to", "mlx"]) == 0
    cfg = json.loads((tmp_path / "mlx" / MLX_CONFIG).read_text())
    assert cfg["num_layers"] == (1 if layers else 2)  # mlx-lm adapts the LAST num_layers
    assert cfg["lora_parameters"]["keys"] == ["mlp.down_proj", "self_attn.q_proj",
                                              "self_attn.v_proj"]
    assert cfg["lora_parameters"]["rank"] == 4 and cfg["lora_parameters"]["scale"] == 3.0
    keys = load_file(tmp_path / "mlx" / MLX_WEIGHTS).keys()
    assert {k.split(".")[2] for k in keys} == ({"1"} if layers else {"0", "1"})
    got = mlx_logits(tiny_llama, tmp_path / "mlx")
    assert np.abs(got - want).max() <= TOL

    # and back: the same tensors, bit for bit, loading in peft with the same logits
    assert main_convert([str(tmp_path / "mlx"), str(tmp_path / "back"), "--to", "peft"]) == 0
    a, b = load_file(peft_dir / PEFT_WEIGHTS), load_file(tmp_path / "back" / PEFT_WEIGHTS)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert np.abs(peft_logits(model, tmp_path / "back") - want).max() <= 1e-6
    assert "converted" in capsys.readouterr().out


@pytest.mark.mlx
def test_export_a_finished_and_an_unfinished_run(tmp_path, tiny_llama, base, capsys):
    """From <state-dir>/final/, and, before the run finished, from the state file."""
    model, _ = base
    peft_dir = make_peft(tmp_path / "peft", tiny_llama, layers_to_transform=[1])
    want = peft_logits(model, peft_dir)
    # a finished run: final/ holds adapter_model.safetensors + adapter_config.json
    state = tmp_path / "finished"
    shutil.copytree(peft_dir, state / "final")
    assert main_export(["--state-dir", str(state), "--out", str(tmp_path / "p"),
                        "--format", "peft"]) == 0
    assert np.abs(peft_logits(model, tmp_path / "p") - want).max() <= 1e-6
    assert main_export(["--state-dir", str(state), "--out", str(tmp_path / "m"),
                        "--format", "mlx", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "the final adapter of" in out
    assert "verify: max |logits(peft) - logits(mlx_lm.load)|" in out
    assert np.abs(mlx_logits(tiny_llama, tmp_path / "m") - want).max() <= TOL

    # a run still going: its last merged Θ, with the adapter config the islands sent
    from yeto.client import SyncerClient
    from yeto.layout import Layout

    tensors = load_file(peft_dir / PEFT_WEIGHTS)
    layout = Layout.from_shapes({k: v.shape for k, v in tensors.items()})
    flat = np.concatenate([tensors[s.name].reshape(-1) for s in layout.specs])
    running = tmp_path / "running"
    with running_syncer(quorum=1, state_dir=running) as (run, address):
        c = SyncerClient(address, "island-0", layout, weights_file=PEFT_WEIGHTS,
                         export_files={PEFT_CONFIG: (peft_dir / PEFT_CONFIG).read_text()})
        c.start(flat)
        assert wait_until(lambda: run.started and c.connected.is_set(), timeout=30)
        assert wait_until(lambda: c.push(
            np.zeros(layout.numel, np.float32).tobytes(), encoding="f32", base_version=0,
            loss_tokens=10, steps=1, seq=0).result(timeout=30).accepted, timeout=30)
        assert wait_until(lambda: run.version >= 1, timeout=30)
        c.close()
        assert not (running / "final").exists()
        assert main_export(["--state-dir", str(running), "--out", str(tmp_path / "mid"),
                            "--format", "mlx"]) == 0
        assert "has not finished" in capsys.readouterr().out
        assert main_export(["--state-dir", str(running), "--out", str(tmp_path / "x"),
                            "--final-only"]) == 2
    # Θ after a zero update is the seed: the adapter we started from, exactly
    assert np.abs(mlx_logits(tiny_llama, tmp_path / "mid") - want).max() <= TOL


@pytest.mark.parametrize("lora, words", [
    (dict(use_rslora=True), "rsLoRA"),
    (dict(use_dora=True), "DoRA"),
    (dict(rank_pattern={"q_proj": 8}), "per-module ranks"),
    (dict(alpha_pattern={"v_proj": 4}), "per-module alphas"),
    (dict(layers_to_transform=[0]), "not the last 1 of 2"),
])
def test_refuses_what_mlx_lm_cannot_express(tmp_path, tiny_llama, lora, words, capsys):
    peft_dir = make_peft(tmp_path / "peft", tiny_llama, **lora)
    assert main_convert([str(peft_dir), str(tmp_path / "mlx"), "--to", "mlx"]) == 2
    err = capsys.readouterr().err
    assert "error: " in err and words in err
    assert not (tmp_path / "mlx" / MLX_WEIGHTS).exists()
    state = tmp_path / "state"
    shutil.copytree(peft_dir, state / "final")
    assert main_export(["--state-dir", str(state), "--out", str(tmp_path / "m2"),
                        "--format", "mlx"]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.mlx
def test_verify_reads_through_plain_mlx_lm_and_names_a_nested_rope_theta(tmp_path, tiny_llama,
                                                                        capsys):
    """transformers 5 saves rope_theta inside rope_parameters; plain mlx-lm reads a
    top-level one and silently uses its default. --verify loaded through yeto's own fix-up
    and could not see it; now it loads with plain mlx_lm.load, fails, and says what the
    base's config.json needs. With the fix in the config, it passes."""
    base = tmp_path / "base"
    shutil.copytree(tiny_llama, base)
    config = json.loads((base / "config.json").read_text())
    config.pop("rope_theta", None)
    config["rope_parameters"] = {**config.get("rope_parameters", {}), "rope_theta": 1e5,
                                 "rope_type": "default"}
    (base / "config.json").write_text(json.dumps(config))
    peft_dir = make_peft(tmp_path / "peft", base)
    argv = [str(peft_dir), str(tmp_path / "mlx"), "--to", "mlx", "--verify",
            "--base-model", str(base)]
    assert main_convert(argv) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and 'add "rope_theta": 100000 at the top level' in out
    config["rope_theta"] = 1e5
    (base / "config.json").write_text(json.dumps(config))
    assert main_convert([*argv, "--force"]) == 0
    assert "(ok, tolerance" in capsys.readouterr().out
