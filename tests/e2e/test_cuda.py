"""The CUDA paths (issue 34): a torch island on a GPU against a local syncer, an FSDP2
island on GPUs (NCCL), the pinned staging of the weights view and the overlapped
push on CUDA weights. Marked `cuda`: skipped without a GPU (tests/conftest.py);
`scripts/gpu_check.sh` runs them. The CPU variants (`slow`) check the same commands
on a machine without one."""

import hashlib
import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from syncer.spawn import start_syncer

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
DEVICES = [pytest.param("cuda", marks=pytest.mark.cuda),
           pytest.param("cpu", marks=pytest.mark.slow)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _island(tmp, address, model, task, device, launcher=(), extra=()):
    train, held_out = task
    cmd = [*(launcher or [sys.executable]), "-m", "yeto.learner", "--model", str(model),
           "--data", str(train), "--eval-data", str(held_out), "--syncer", address,
           "--max-steps", "12",
           "--sync-every", "4", "--seq-len", "64", "--batch-size", "4", "--no-progress",
           "--threads", "1", "--tuning", "full", "--inner-lr", "1e-4", "--eval-blocks", "8",
           "--device", device, "--learner-id", "island-0", "--output", str(tmp / "i0"), *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(tmp / "i0.log", "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _run_to_the_end(tmp_path, tiny_llama, tiny_task, device, launcher=(), extra=()):
    """One island (quorum 1) trains 12 steps, pushing every 4; its saved model is the
    syncer's final weights, bit for bit."""
    syncer = start_syncer(["--quorum", "1", "--state-dir", str(tmp_path / "s"),
                           "--round-timeout-s", "60"], cwd=ROOT, log=tmp_path / "syncer.log")
    island = _island(tmp_path, syncer.address, tiny_llama, tiny_task, device, launcher, extra)
    try:
        assert island.wait(timeout=600) == 0, (tmp_path / "i0.log").read_text()[-4000:]
        assert syncer.wait(timeout=60) == 0
    finally:
        for p in (island, syncer):
            if p.poll() is None:
                p.kill()
    final = load_file(tmp_path / "s" / "final" / "model.safetensors")
    mine = load_file(tmp_path / "i0" / "model" / "model.safetensors")
    assert all(np.array_equal(mine[k], final[k]) for k in final)
    summary = json.loads((tmp_path / "i0" / "summary.json").read_text())
    assert summary["final"] and summary["pushes"] >= 3, summary
    return summary


@pytest.mark.parametrize("device", DEVICES)
def test_torch_island_ends_on_the_syncer_weights(tmp_path, tiny_llama, tiny_task, device):
    _run_to_the_end(tmp_path, tiny_llama, tiny_task, device)


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed")
@pytest.mark.parametrize("sharding", [["--fsdp"], []], ids=["fsdp2", "ddp"])
@pytest.mark.parametrize("device", DEVICES)
def test_torchrun_island_ends_on_the_syncer_weights(tmp_path, tiny_llama, tiny_task, device,
                                                    sharding):
    """A torchrun island over every GPU of the machine (NCCL for CUDA tensors; one
    process on CPU): FSDP2-sharded, or replicated (DDP)."""
    nproc = max(1, torch.cuda.device_count()) if device == "cuda" else 1
    launcher = [str(TORCHRUN), "--nproc-per-node", str(nproc), "--master-port",
                str(_free_port())]
    summary = _run_to_the_end(tmp_path, tiny_llama, tiny_task, device, launcher, sharding)
    assert summary.get("ranks", 1) == nproc


@pytest.mark.parametrize("device", DEVICES)
def test_weights_view_and_overlapped_push_on_the_device(device):
    """The weights view reads and writes a model on `device` through the pinned
    staging buffer bit for bit, and an island over it pushes the bytes of the same
    island over the CPU model (pushes overlapped with training, blocking sync)."""
    from helpers.island_chunked import HeldSyncer

    from yeto.island import Island
    from yeto.torch.weights import TorchWeights

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 50))

    on_device = TorchWeights(model().to(device), "full")
    on_cpu = TorchWeights(model(), "full")
    flat = on_cpu.get()
    assert on_device.get().tobytes() == flat.tobytes()
    values = np.random.default_rng(1).standard_normal(flat.size).astype(np.float32)
    on_device.write_range(100, 70_000, values[100:70_000])
    assert on_device.read_range(100, 70_000).tobytes() == values[100:70_000].tobytes()
    on_device.set(flat)
    digests = []
    for weights in (on_device, on_cpu):
        syncer = HeldSyncer(weights.layout, delay=1)
        island = Island(weights, client=syncer, sync_every=3, blocking=True, overlap=True,
                        chunk=4096)
        island.start()
        target = np.linspace(-1, 1, flat.size, dtype=np.float32)
        for _ in range(9):
            w = weights.get()
            weights.set(w - np.float32(0.05) * (w - target))
            syncer.clock += 1
            island.after_step(10)
        assert island.finish() and len(syncer.payloads) >= 3
        digests.append(hashlib.sha256(b"".join(syncer.payloads) + weights.get().tobytes())
                       .hexdigest())
    assert digests[0] == digests[1]
