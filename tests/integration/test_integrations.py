"""The Python API: the examples (a torch loop, a HF Trainer, mlx-lm's trainer) run
against a real in-process syncer on the tiny model, and end bit-identical to it.

Here: the checks through in-process servers, training or the sim (the others:
tests/unit/test_integrations.py)."""


import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from helpers.syncer import running_syncer
from safetensors.numpy import load_file

from syncer.tape import read_tape
from yeto.interop.integrations import batch_loss_tokens

ROOT = Path(__file__).resolve().parents[2]


def example(name: str):
    """examples/<name>.py, loaded from its file (a user runs it as a script)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _merges(state: Path) -> list[dict]:
    return [r for r in read_tape(state / "tape.jsonl") if r["event"] == "merge"]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_torch_loop_example(tmp_path, tiny_llama, tiny_task):
    torch_loop = example("torch_loop")

    train, _ = tiny_task
    state, out = tmp_path / "state", tmp_path / "island-0"
    with running_syncer(quorum=1, state_dir=state) as (run, address):
        assert torch_loop.main(["--model", str(tiny_llama), "--data", str(train), "--syncer",
                                address, "--max-steps", "6", "--sync-every", "2",
                                "--batch-size", "4", "--output", str(out)]) == 0
        assert run.finished and run.version == 3
    merges = _merges(state)
    assert [m["responders"][0]["steps"] for m in merges] == [2, 2, 2]
    assert all(m["responders"][0]["tokens"] > 0 and m["responders"][0]["train_loss"] > 0
               for m in merges)
    # the loop's model ends holding the syncer's final weights, bit for bit
    final = load_file(state / "final" / "adapter_model.safetensors")
    mine = load_file(out / "adapter" / "adapter_model.safetensors")
    assert mine.keys() == final.keys() and len(final) == 8  # q, v on 2 layers: A and B
    assert all(np.array_equal(mine[k], final[k]) for k in final)
    cfg = json.loads((state / "final" / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["peft_type"] == "LORA"
    recs = _records(out / "metrics.jsonl")
    assert recs[0]["step"] == 0 and recs[-1]["final"] is True and recs[-1]["step"] == 6
    assert recs[-1]["loss_tokens"] == sum(m["responders"][0]["tokens"] for m in merges)
    assert any(r.get("tokens_per_s", 0) > 0 for r in recs)


def test_hf_trainer_callback_example(tmp_path, tiny_llama, tiny_task):
    """Gradient accumulation 2: one push per 2 optimizer steps, each carrying the
    loss tokens of 4 micro-batches, and the Trainer's model ends on the final Θ."""
    hf_trainer = example("hf_trainer")

    train, _ = tiny_task
    state, out = tmp_path / "state", tmp_path / "island-0"
    with running_syncer(quorum=1, state_dir=state) as (run, address):
        assert hf_trainer.main(["--model", str(tiny_llama), "--data", str(train), "--syncer",
                                address, "--max-steps", "4", "--sync-every", "2",
                                "--batch-size", "2", "--grad-accum", "2",
                                "--output", str(out)]) == 0
        assert run.finished and run.version == 2
    merges = _merges(state)
    assert [m["responders"][0]["steps"] for m in merges] == [2, 2]
    # tokens: labels != -100 after the shift, over the 4 micro-batches of 2 steps;
    # the prompt is masked, so a row of the task has 5-12 answer tokens
    tokens = [m["responders"][0]["tokens"] for m in merges]
    assert all(8 * 4 <= t <= 8 * 14 for t in tokens), tokens
    assert all(1.0 < m["responders"][0]["train_loss"] < 5.0 for m in merges)
    final = load_file(state / "final" / "adapter_model.safetensors")
    mine = load_file(out / "adapter" / "adapter_model.safetensors")
    assert mine.keys() == final.keys()
    assert all(np.array_equal(mine[k], final[k]) for k in final)
    assert _records(out / "metrics.jsonl")[-1]["final"] is True


@pytest.mark.mlx
def test_mlx_lm_trainer_example(tmp_path, tiny_llama, tiny_task):
    pytest.importorskip("mlx_lm")
    mlx_lm_trainer = example("mlx_lm_trainer")

    train, _ = tiny_task
    state, out = tmp_path / "state", tmp_path / "island-1"
    with running_syncer(quorum=1, state_dir=state) as (run, address):
        assert mlx_lm_trainer.main(["--model", str(tiny_llama), "--data", str(train),
                                    "--syncer", address, "--max-steps", "6", "--sync-every",
                                    "2", "--batch-size", "4", "--output", str(out)]) == 0
        assert run.finished and run.version == 3
    merges = _merges(state)
    assert [m["responders"][0]["steps"] for m in merges] == [2, 2, 2]
    assert all(m["responders"][0]["tokens"] > 0 for m in merges)
    # synced under peft's names: the syncer's final/ is a peft adapter whose tensors
    # are the MLX model's lora_a / lora_b, transposed, bit for bit
    final = load_file(state / "final" / "adapter_model.safetensors")
    mine = load_file(out / "adapters.safetensors")
    assert len(mine) == len(final) == 8
    for k, v in mine.items():
        module, which = k.rsplit(".lora_", 1)
        assert np.array_equal(v.T, final[f"base_model.model.{module}.lora_{which.upper()}.weight"])
    cfg = json.loads((state / "final" / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 16.0
    assert cfg["base_model_name_or_path"] == str(tiny_llama)


@pytest.mark.mlx
def test_mlx_and_torch_islands_share_a_run(tmp_path, tiny_llama, tiny_task):
    """mlx-lm's trainer and a torch loop (same targets, rank, scale) in one run."""
    pytest.importorskip("mlx_lm")
    import threading

    mlx_lm_trainer = example("mlx_lm_trainer")
    torch_loop = example("torch_loop")

    train, _ = tiny_task
    state = tmp_path / "state"
    common = ["--model", str(tiny_llama), "--data", str(train), "--max-steps", "4",
              "--sync-every", "2", "--batch-size", "4"]
    with running_syncer(quorum=2, state_dir=state, grace_ms=50) as (run, address):
        codes = {}
        t = threading.Thread(target=lambda: codes.update(torch=torch_loop.main(
            [*common, "--syncer", address, "--learner-id", "island-0", "--shard", "0/2",
             "--output", str(tmp_path / "t")])))
        t.start()
        codes["mlx"] = mlx_lm_trainer.main([*common, "--syncer", address, "--learner-id",
                                            "island-1", "--shard", "1/2",
                                            "--output", str(tmp_path / "m")])
        t.join(timeout=300)
        assert codes == {"torch": 0, "mlx": 0} and run.finished
    for m in _merges(state):
        assert sorted(x["learner"] for x in m["responders"]) == ["island-0", "island-1"]
    final = load_file(state / "final" / "adapter_model.safetensors")
    torch_side = load_file(tmp_path / "t" / "adapter" / "adapter_model.safetensors")
    assert all(np.array_equal(torch_side[k], final[k]) for k in final)


def test_batch_loss_tokens_matches_mlx_lm_default_loss():
    mx = pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    tokens = mx.zeros((3, 9), dtype=mx.int32)
    lengths = mx.array([[0, 9], [3, 6], [2, 20]])
    steps = mx.arange(1, 9)  # default_loss: targets at 1..T-1, offset <= step <= length
    mask = (steps >= lengths[:, 0:1]) & (steps <= lengths[:, 1:])
    assert batch_loss_tokens((tokens, lengths)) == int(mask.sum()) == 8 + 4 + 7
