"""A numpy island for fault tests, soak runs and simulations: no model, real sync.

It "trains" w on a quadratic pulled toward its own target (so islands disagree,
like islands with different data), through the real Island and client.

    python scripts/synthetic_island.py --syncer 127.0.0.1:29400 --learner-id sim-0 \\
        --steps 200 --sync-every 10 --record runs/sim-0.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from yeto.client import SyncerClient  # noqa: E402
from yeto.island import Island  # noqa: E402
from yeto.layout import Layout  # noqa: E402


def layout_for(dim: int) -> Layout:
    half = dim // 2
    return Layout.from_shapes({"sim.layers.0.lora_A.weight": (half,),
                               "sim.layers.0.lora_B.weight": (dim - half,)})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--syncer", required=True)
    p.add_argument("--learner-id", required=True)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--wire", default="q4")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (pacing)")
    p.add_argument("--tokens", type=int, default=100, help="loss tokens per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--blocking-sync", action="store_true")
    p.add_argument("--token", default=None)
    p.add_argument("--record", type=Path, default=None,
                   help="JSONL: one line per applied version with the weights' SHA-256")
    args = p.parse_args(argv)
    logging.basicConfig(level="INFO", format=f"%(asctime)s {args.learner_id} %(message)s")
    layout = layout_for(args.dim)
    rng = np.random.default_rng(args.seed)
    target = rng.standard_normal(layout.numel).astype(np.float32)
    w = {"v": np.zeros(layout.numel, np.float32)}

    def record(event: str, **kw) -> None:
        if args.record:
            with open(args.record, "a") as f:
                f.write(json.dumps(dict(event=event, learner=args.learner_id, **kw)) + "\n")

    def set_weights(x: np.ndarray) -> None:
        w["v"] = x.astype(np.float32, copy=True)

    client = SyncerClient(args.syncer, args.learner_id, layout, token=args.token,
                          backend="numpy", backoff_s=0.1, max_backoff_s=1.0)
    def on_apply(got) -> None:
        record("applied", version=got.version, final=got.final,
               theta_sha256=hashlib.sha256(got.theta.tobytes()).hexdigest())

    island = Island(layout, lambda: w["v"].copy(), set_weights, client=client,
                    sync_every=args.sync_every, wire=args.wire, blocking=args.blocking_sync,
                    on_apply=on_apply, connect_grace_s=30.0)
    island.start()
    for _ in range(args.steps):
        w["v"] -= args.lr * (w["v"] - target)
        if args.step_seconds:
            time.sleep(args.step_seconds)
        if island.after_step(args.tokens, train_loss=float(np.mean((w["v"] - target) ** 2))):
            break
    island.finish()
    record("done", version=island.version, final=island.finished, step=island.step,
           weights_sha256=hashlib.sha256(w["v"].tobytes()).hexdigest())
    return 0


if __name__ == "__main__":
    sys.exit(main())
