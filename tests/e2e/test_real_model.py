"""A real pretrained checkpoint, first-class: SmolLM2-135M-Instruct as the GGUF file the
package index ships (`yeto.testing.real`; fetched at set-up, never in the default tier),
read by every program as `--model FILE.gguf` (`yeto.gguf`):

- torch and MLX compute the same model on it (LoRA on the default targets and on every
  linear), to the parity bound;
- a federated LoRA run of two torch islands on real text (the Python standard library's
  own documentation) lowers held-out loss, and its adapter loads in peft and in plain
  `mlx_lm.load(base, adapter_path=...)` with the same logits;
- the rollout node's logprobs equal transformers' own on the same checkpoint;
- the island benchmark (scripts/bench_island.py --model) runs on it.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from yeto import gguf
from yeto.testing.real import FETCH, SMOLLM2, stdlib_docs

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.real]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    path = SMOLLM2.available()
    if path is None:
        pytest.skip(f"SmolLM2 is not fetched: run {FETCH}")
    return path


@pytest.fixture(scope="module")
def smollm2_dir(smollm2) -> Path:
    return gguf.model_dir(smollm2)


@pytest.mark.mlx
@pytest.mark.parametrize("targets", ["auto", "all-linear"])
def test_torch_and_mlx_compute_the_same_model_on_a_real_checkpoint(smollm2, targets):
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed")
    r = subprocess.run([sys.executable, "-m", "yeto", "check-parity", "--model", str(smollm2),
                        "--lora-targets", targets], cwd=ROOT, capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "parity: OK" in r.stdout


@pytest.mark.mlx
def test_a_federated_run_on_real_text_learns_and_its_adapter_loads_in_peft_and_mlx_lm(
        smollm2, smollm2_dir, tmp_path):
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed")
    train, held = stdlib_docs(tmp_path)
    out = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "yeto", "launch", "--islands", "torch,torch", "--model",
         str(smollm2), "--data", str(train), "--eval-data", str(held), "--out", str(out),
         "--display", "plain", "--seq-len", "128", "--batch-size", "2", "--lora-r", "8",
         "--eval-blocks", "8", "--max-steps", "16", "--sync-every", "8", "--threads", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_loss_after"] < summary["eval_loss_before"] - 0.05, summary
    peft_dir, mlx_dir = tmp_path / "peft", tmp_path / "mlx"
    for fmt, where in (("peft", peft_dir), ("mlx", mlx_dir)):
        e = subprocess.run([sys.executable, "-m", "yeto", "export", "--state-dir",
                            str(out / "syncer"), "--out", str(where), "--format", fmt],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert e.returncode == 0, e.stderr[-2000:]
    ids = [[1, 504, 2657, 314, 253, 1345, 30, 378, 12, 9789, 4183, 28]]
    torch_logits = _peft_logits(smollm2_dir, peft_dir, ids)
    mlx_logits = _mlx_lm_logits(smollm2_dir, mlx_dir, ids)
    assert np.abs(torch_logits - mlx_logits).max() <= 2e-3 * max(1.0, np.abs(torch_logits).max())
    assert (torch_logits.argmax(-1) == mlx_logits.argmax(-1)).all()


def _peft_logits(base: Path, adapter: Path, ids) -> np.ndarray:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(adapter)).eval()
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def _mlx_lm_logits(base: Path, adapter: Path, ids) -> np.ndarray:
    """Plain mlx-lm, as a user loads an export: no yeto code on this path."""
    import mlx.core as mx
    import mlx_lm

    model, _ = mlx_lm.load(str(base), adapter_path=str(adapter))
    model.set_dtype(mx.float32)
    return np.array(model(mx.array(ids)))


def test_the_rollout_node_logprobs_equal_transformers_on_a_real_checkpoint(smollm2,
                                                                          smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from yeto.rollout.engine import stop_token_ids
    from yeto.rollout.server import RolloutNode, serve_in_thread
    from yeto.rollout.torch_engine import TorchEngine

    engine = TorchEngine(smollm2)  # the .gguf file, as `python -m yeto.rollout --model` takes it
    node = RolloutNode(engine, model_name="smollm2",
                       eos_ids=stop_token_ids(engine.model_dir, engine.tokenizer))
    server, url = serve_in_thread(node)
    try:
        prompt = engine.tokenizer("The json module encodes", add_special_tokens=False).input_ids
        body = dict(prompt=[prompt], n=2, max_tokens=8, temperature=1.0, seed=3, logprobs=0,
                    return_tokens_as_token_ids=True)
        import urllib.request

        req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=600) as resp:
            reply = json.loads(resp.read())
    finally:
        server.shutdown()
        server.server_close()
        node.close()
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    for choice in reply["choices"]:
        ids = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0]
        lp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(
            1, torch.tensor(ids)[:, None])[:, 0].numpy()
        assert np.abs(np.array(choice["logprobs"]["token_logprobs"]) - lp).max() <= 1e-4


def test_the_island_benchmark_runs_on_a_real_checkpoint(smollm2):
    """bench_island.py --model FILE.gguf (tiny sizes): the torch island against a bare peft
    loop on SmolLM2 and real text; the last line is a RESULT line with both tokens/s and a
    timed push. Speed is not asserted."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_island.py"), "--model",
                        str(smollm2), "--batch-size", "1", "--seq-len", "32", "--steps", "2",
                        "--sync-every", "1", "--repeats", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT ratio="), last
    fields = dict(kv.split("=", 1) for kv in last.split()[1:])
    assert fields["model"] == "SmolLM2-135M-Instruct" and int(fields["pushes"]) >= 1, last
    for key in ("ratio", "cpu_ratio", "bare_tok_s", "island_tok_s"):
        assert float(fields[key]) > 0, last
