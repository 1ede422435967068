"""The MLX island: config shim, outputs (peft + mlx-lm adapters), a mixed
torch + MLX run against a real syncer process.

Here: the checks through in-process servers, training or the sim (the others:
tests/unit/test_mlx_island.py, tests/e2e/test_mlx_island.py)."""


import json

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'yeto[mlx]')")


pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'yeto[mlx]')")


import torch  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from yeto.mlx.load import load_model as shim_load_model  # noqa: E402
from yeto.testing.tiny import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.mlx


SUMMARY_KEYS = {"step", "eval_loss", "eval_loss_before", "version", "final", "loss_tokens",
                "pushes", "bytes_up", "bytes_down", "wait_s", "ranks",
                "tokens_per_s"}  # IslandDriver.summary, the same for both backends


IDS = np.arange(5, 69, dtype=np.int32).reshape(2, 32)


def _torch_logits(model_dir, adapter=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(IDS).long()).logits.numpy()


@pytest.mark.parametrize("arch, theta", [("qwen2", 1e4), ("llama", 5e5)])
def test_rope_parameters_shim(arch, theta, tmp_path):
    """A config.json as transformers 5 writes it (rope_theta only nested under
    rope_parameters): mlx-lm alone builds the model with its own default theta
    (qwen2 1e6, llama 1e4) and wrong logits; with the shim it matches torch."""
    from mlx_lm.utils import load_model as plain_load_model

    d = make_tiny_model(tmp_path / arch, arch, pretrain=False)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("rope_theta", None)
    cfg["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
    (d / "config.json").write_text(json.dumps(cfg))
    want = _torch_logits(d)
    model, _ = shim_load_model(d)
    assert np.abs(np.array(model(mx.array(IDS))) - want).max() < 1e-4
    plain, _ = plain_load_model(d)
    assert np.abs(np.array(plain(mx.array(IDS))) - want).max() > 1e-2  # what the shim fixes


# ---- the island's outputs ---------------------------------------------------
@pytest.fixture(scope="module")
def island_out(tiny_llama, tiny_task, tmp_path_factory):
    from yeto.mlx.learner import main

    out = tmp_path_factory.mktemp("mlx-island")
    train, held_out = tiny_task
    rc = main(["--model", str(tiny_llama), "--data", str(train), "--eval-data", str(held_out),
               "--max-steps", "4", "--sync-every", "2", "--seq-len", "32", "--batch-size", "2",
               "--lora-r", "4", "--lora-targets", "all-linear", "--inner-lr", "2e-2",
               "--eval-blocks", "4", "--output", str(out), "--no-progress"])
    assert rc == 0
    return out


def test_outputs_mirror_the_torch_island(island_out, tiny_llama):
    from yeto.torch.model import attach_lora, export_files, load_base

    s = json.loads((island_out / "summary.json").read_text())
    assert set(s) == SUMMARY_KEYS and s["step"] == 4 and s["loss_tokens"] > 0
    lines = [json.loads(x) for x in (island_out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 2, 4, 4] and set(lines[-1]) == SUMMARY_KEYS
    live = json.loads((island_out / "progress.json").read_text())  # between pushes
    assert 1 <= live["step"] <= 4 and live["train_loss"] > 0
    assert (island_out / "provenance.json").is_file()
    assert (island_out / "adapter" / "provenance.json").is_file()
    assert json.loads((island_out / "provenance.json").read_text())["backend"] == "mlx"
    # adapter_config.json: the content peft writes for the torch island, same flags
    torch_model = attach_lora(load_base(str(tiny_llama))[0], 4, 32.0, "all-linear", 0)
    want = json.loads(export_files(torch_model, "lora")[1]["adapter_config.json"])
    got = json.loads((island_out / "adapter" / "adapter_config.json").read_text())
    assert sorted(got.pop("target_modules")) == sorted(want.pop("target_modules"))
    assert got == want
    tensors = load_file(str(island_out / "adapter" / "adapter_model.safetensors"))
    assert len(tensors) == 28 and all(v.dtype == np.float32 for v in tensors.values())


def test_peft_and_mlx_lm_adapters_reproduce_the_island(island_out, tiny_llama):
    import mlx_lm

    from yeto.mlx.learner import build_lora_model
    from yeto.mlx.lora import LoRAWeights

    # the island's own model with the saved weights
    model, _, layers = build_lora_model(tiny_llama, 4, 32, "all-linear", 0)
    w = LoRAWeights(layers)
    w.set(w.layout.flatten(load_file(str(island_out / "adapter" / "adapter_model.safetensors"))))
    mine = np.array(model(mx.array(IDS)))
    base = _torch_logits(tiny_llama)
    assert np.abs(mine - base).max() > 1e-2  # the adapter is not a no-op
    # peft
    peft_logits = _torch_logits(tiny_llama, island_out / "adapter")
    assert np.abs(peft_logits - mine).max() < 1e-4
    # mlx-lm
    lm, _ = mlx_lm.load(str(tiny_llama), adapter_path=str(island_out / "mlx"))
    assert np.abs(np.array(lm(mx.array(IDS))) - mine).max() < 1e-4


def test_bad_targets_and_missing_model_exit_2(tiny_llama, tiny_task, tmp_path, capsys):
    from yeto.mlx.learner import main

    train, _ = tiny_task
    assert main(["--model", str(tmp_path / "nope"), "--data", str(train)]) == 2
    assert main(["--model", str(tiny_llama), "--data", str(train), "--lora-targets",
                 "nothing_proj"]) == 2
