"""A torch island and an MLX island in one run against a real syncer process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from syncer.spawn import start_syncer
from syncer.tape import read_tape

ROOT = Path(__file__).resolve().parents[2]


def mixed_run(model, task, out: Path, steps: int, sync_every: int, seq_len: int,
              batch_size: int, inner_lr: str, lora_r: int = 8,
              targets: str = "auto") -> dict:
    """A real syncer process + a torch island + an MLX island; returns their summaries."""
    train, held_out = task
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    syncer_log = open(out / "syncer.log", "w")
    syncer = start_syncer(["--quorum", "2", "--state-dir", str(out / "s"), "--outer-lr", "1.0",
                           "--outer-momentum", "0.0"], cwd=ROOT, log=syncer_log)
    procs = {}
    try:
        for i, module in enumerate(("yeto.learner", "yeto.mlx.learner")):
            iid = f"island-{i}"
            cmd = [sys.executable, "-m", module, "--model", str(model), "--data", str(train),
                   "--eval-data", str(held_out), "--syncer", syncer.address,
                   "--learner-id", iid, "--num-learners", "2", "--max-steps", str(steps),
                   "--sync-every", str(sync_every), "--seq-len", str(seq_len),
                   "--batch-size", str(batch_size), "--lora-r", str(lora_r),
                   "--lora-targets", targets, "--inner-lr", inner_lr,
                   "--eval-blocks", "16", "--output", str(out / iid), "--no-progress"]
            if module == "yeto.learner":
                cmd += ["--threads", "1"]
            procs[iid] = subprocess.Popen(cmd, cwd=ROOT, env=env,
                                          stdout=open(out / f"{iid}.log", "w"),
                                          stderr=subprocess.STDOUT)
        codes = {k: p.wait(timeout=900) for k, p in procs.items()}
        syncer.proc.wait(timeout=120)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        syncer.stop()
        syncer_log.close()
    logs = {k: (out / f"{k}.log").read_text()[-3000:] for k in procs}
    assert codes == {"island-0": 0, "island-1": 0}, logs

    # every island ends bit-identical to the syncer's final adapter
    final = load_file(str(out / "s" / "final" / "adapter_model.safetensors"))
    summaries = {}
    for iid in procs:
        mine = load_file(str(out / iid / "adapter" / "adapter_model.safetensors"))
        assert mine.keys() == final.keys()
        for k in final:
            assert mine[k].dtype == final[k].dtype == np.float32
            assert np.array_equal(mine[k], final[k]), (iid, k)
        summaries[iid] = json.loads((out / iid / "summary.json").read_text())
        assert summaries[iid]["final"], summaries[iid]
    # both islands in every round
    merges = [r for r in read_tape(out / "s" / "tape.jsonl") if r["event"] == "merge"]
    assert len(merges) == steps // sync_every
    for rec in merges:
        assert sorted(x["learner"] for x in rec["responders"]) == ["island-0", "island-1"]
        assert all(x["tokens"] > 0 for x in rec["responders"])
    cfg = json.loads((out / "s" / "final" / "adapter_config.json").read_text())
    assert cfg["r"] == lora_r and cfg["peft_type"] == "LORA"
    # same final weights, same held-out blocks: both backends measure the same loss
    a, b = summaries["island-0"], summaries["island-1"]
    assert abs(a["eval_loss"] - b["eval_loss"]) < 1e-4
    assert abs(a["eval_loss_before"] - b["eval_loss_before"]) < 1e-4
    return summaries
