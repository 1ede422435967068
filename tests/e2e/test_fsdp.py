"""FSDP islands: a torchrun group (2 CPU processes, gloo) that shards the model with
FSDP2 and syncs through rank 0, one tensor at a time.

- ShardedWeights on a small module with odd shapes (uneven shards) reads, writes
  and digests exactly what an unsharded copy holds;
- an FSDP island of 2 ranks and a plain island train one
  full-weight model together against a real syncer; every rank of both islands ends
  on the syncer's final weights, bit for bit, and the held-out loss falls.
"""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from syncer.spawn import start_syncer
from yeto.layout import Layout

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
needs_torchrun = pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed")

SMOKE = r'''
import gc, hashlib, json, sys
import numpy as np, torch, torch.distributed as dist
from yeto.torch.fsdp import FSDPGroup, ShardedWeights, shard_model
from yeto.torch.weights import TorchWeights

dist.init_process_group("gloo")
group = FSDPGroup(dist.get_rank(), dist.get_world_size())
torch.manual_seed(0)
make = lambda: torch.nn.Sequential(torch.nn.Linear(13, 29), torch.nn.ModuleList(
    [torch.nn.Linear(29, 7), torch.nn.Linear(7, 5)]), torch.nn.Linear(5, 3, bias=False))
plain = make()
model = make()
model.load_state_dict(plain.state_dict())
shard_model(model, group)
weights, ref = ShardedWeights(model, "full", group), TorchWeights(plain, "full")
n = weights.layout.numel
out = {"layout": weights.layout.fingerprint == ref.layout.fingerprint,
       "digest0": weights.digest() == hashlib.sha256(ref.get().tobytes()).hexdigest()}
new = np.random.default_rng(1).standard_normal(n).astype(np.float32)
if group.leader:  # the island's passes: reads and writes in odd pieces across tensors
    got = np.concatenate([weights.read_range(lo, min(lo + 50, n)) for lo in range(0, n, 50)])
    out["read"] = got.tobytes() == ref.get().tobytes()
    for lo in range(0, n, 70):
        weights.write_range(lo, min(lo + 70, n), new[lo:lo + 70])
    weights.flush()
    half = weights.read_range(0, 100)
    weights.flush()
    out["reread"] = half.tobytes() == new[:100].tobytes()
    group.share(True, weights)
else:
    group.share(True, weights)
out["digest1"] = weights.digest() == hashlib.sha256(new.tobytes()).hexdigest()
out["uneven"] = any(s * group.world != p.shape[0] for s, p in zip(
    [p.to_local().shape[0] for p in weights._ordered], weights._ordered))
with open(f"{sys.argv[1]}/rank{dist.get_rank()}.json", "w") as f:  # one file per rank
    json.dump(out, f)
del model, weights  # the sharded tensors hold the process group: free them first
gc.collect()
dist.barrier()  # as TorchGroup.close: no rank tears down while another still works
dist.destroy_process_group()
'''


@needs_torchrun
def test_sharded_weights_read_write_digest_exactly(tmp_path, free_port):
    script = tmp_path / "smoke.py"
    script.write_text(SMOKE)
    proc = subprocess.run([str(TORCHRUN), "--nproc-per-node", "2", "--master-port",
                           str(free_port), str(script), str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)}
    assert results[0] == {"layout": True, "digest0": True, "read": True, "reread": True,
                          "digest1": True, "uneven": True}
    assert results[1] == {"layout": True, "digest0": True, "digest1": True, "uneven": True}


@pytest.fixture
def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _islands(tmp, address, model, task, port, steps, extra=()):
    train, held_out = task
    common = ["--model", str(model), "--data", str(train), "--eval-data", str(held_out),
              "--syncer", address, "--num-learners", "2", "--max-steps", str(steps),
              "--sync-every", "6", "--seq-len", "128", "--batch-size", "8", "--no-progress",
              "--threads", "1", "--tuning", "full", "--inner-lr", "1e-4", "--eval-blocks", "24",
              *extra]
    fsdp = subprocess.Popen([str(TORCHRUN), "--nproc-per-node", "2", "--master-port", str(port),
                             "-m", "yeto.learner", "--fsdp", *common, "--learner-id", "island-0",
                             "--output", str(tmp / "i0")], cwd=ROOT,
                            stdout=open(tmp / "i0.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    plain = subprocess.Popen([sys.executable, "-m", "yeto.learner", *common, "--learner-id",
                              "island-1", "--output", str(tmp / "i1")], cwd=ROOT,
                             stdout=open(tmp / "i1.log", "w"), stderr=subprocess.STDOUT)
    return fsdp, plain


def _flat_digest(tensors: dict) -> str:
    layout = Layout.from_shapes({k: v.shape for k, v in tensors.items()})
    return hashlib.sha256(layout.flatten(tensors).tobytes()).hexdigest()


@needs_torchrun
def test_fsdp_island_and_plain_island_end_on_the_syncer_weights(tmp_path, tiny_llama,
                                                                 tiny_task, free_port):
    syncer = start_syncer(["--quorum", "2", "--state-dir", str(tmp_path / "s"),
                           "--round-timeout-s", "60"], cwd=ROOT, log=tmp_path / "syncer.log")
    fsdp, plain = _islands(tmp_path, syncer.address, tiny_llama, tiny_task, free_port, 30)
    try:
        assert fsdp.wait(timeout=600) == 0, (tmp_path / "i0.log").read_text()[-4000:]
        assert plain.wait(timeout=600) == 0, (tmp_path / "i1.log").read_text()[-4000:]
        assert syncer.wait(timeout=60) == 0
    finally:
        for p in (fsdp, plain, syncer):
            if p.poll() is None:
                p.kill()
    final = load_file(tmp_path / "s" / "final" / "model.safetensors")
    for island in ("i0", "i1"):  # the saved models (rank 0 gathered the FSDP one)
        mine = load_file(tmp_path / island / "model" / "model.safetensors")
        assert all(np.array_equal(mine[k], final[k]) for k in final), island
    # every rank of the FSDP island: its shards, gathered, are the final weights
    want = _flat_digest(final)
    ranks = [[json.loads(x) for x in (tmp_path / "i0" / f"rank-{r}.jsonl").read_text()
              .splitlines()] for r in (0, 1)]
    assert ranks[0] == ranks[1] and len(ranks[0]) >= 3
    assert ranks[0][-1]["weights_sha256"] == want
    for island in ("i0", "i1"):
        s = json.loads((tmp_path / island / "summary.json").read_text())
        assert s["final"] and s["eval_loss"] < s["eval_loss_before"], s
    assert json.loads((tmp_path / "i0" / "summary.json").read_text())["ranks"] == 2
