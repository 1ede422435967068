"""A numpy island for fault tests, soak runs and simulations: no model, real sync.

It "trains" w on a quadratic pulled toward its own target (so islands disagree,
like islands with different data), through the real Island and client.

    python -m yeto.testing.synthetic --syncer 127.0.0.1:29400 --learner-id sim-0 \\
        --steps 200 --sync-every 10 --record runs/sim-0.jsonl

It is lean at any --dim (scripts/bench_memory.py runs it at 5e8 parameters): it holds
its weights w (4 B per parameter) and hands the island range access to them (no
copies); the target is one chunk of random values repeated (its first --dim values
when --dim fits one chunk), and each step runs chunk by chunk. A step is a training
step's two parts: a read-only pass (the loss and the gradient w - target, as a
forward and backward read the weights), then the island's guard
(`Island.before_update`: a push may be staged in the background meanwhile), then the
update (the gradient recomputed per chunk: no gradient buffer). `--stage-in-loop`
leaves the guard out: each push is staged in the training loop instead;
`--alternate-guard` has every other push staged in the loop (the guard and its
baseline in one run). The "done" record carries the process's peak RSS (VmHWM), CPU
seconds (user + system), and per push the seconds the loop waited for it
(`blocked_s`: the push, then the guard) and its encode took (`encode_s`, on the
background thread; behind the guard it stages there first, and `stage_s` says how
long that took, per push so staged), and for the pushes of the training steps whether
each was staged behind the guard (`guarded`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

from yeto.client import connect
from yeto.island import Island, Weights
from yeto.layout import Layout

CHUNK = 1 << 20  # values per piece of a step, and the period of the target


LAYOUTS = ("lora", "full")


def layout_for(dim: int, kind: str = "lora") -> Layout:
    """`dim` values as a LoRA pair (``lora``: two tensors) or as a full model's weights
    (``full``: four big tensors, as a state dict has)."""
    if kind == "lora":
        half = dim // 2
        return Layout.from_shapes({"sim.layers.0.lora_A.weight": (half,),
                                   "sim.layers.0.lora_B.weight": (dim - half,)})
    if kind != "full":
        raise ValueError(f"layout {kind!r}: one of {LAYOUTS}")
    parts = 4
    sizes = [dim // parts] * (parts - 1) + [dim - (parts - 1) * (dim // parts)]
    return Layout.from_shapes({f"model.layers.{i}.mlp.weight": (n,) for i, n in enumerate(sizes)})


def peak_rss_kib() -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None


class Quadratic(Weights):
    """w pulled toward a target: w -= lr * (w - target), one chunk at a time. Its
    weights are a `yeto.island.Weights` with range access (reads are views of w)."""

    ranged = True

    def __init__(self, layout: Layout, seed: int, lr: float):
        self.layout = layout
        numel = layout.numel
        self.w = np.zeros(numel, np.float32)
        self.target = np.random.default_rng(seed).standard_normal(
            min(numel, CHUNK)).astype(np.float32)
        self.lr = np.float32(lr)
        self._diff = np.empty(min(numel, CHUNK), np.float32)

    def gradient(self) -> float:
        """The read-only part of a step: the gradient w - target, chunk by chunk, and
        the loss (the mean squared distance to the target), which it returns."""
        total = 0.0
        for lo in range(0, self.w.size, CHUNK):
            w = self.w[lo:lo + CHUNK]
            d = np.subtract(w, self.target[:w.size], out=self._diff[:w.size])
            total += float(np.dot(d, d))
        return total / max(self.w.size, 1)

    def update(self) -> None:
        """The part of a step that changes w: w -= lr * (w - target)."""
        for lo in range(0, self.w.size, CHUNK):
            w = self.w[lo:lo + CHUNK]
            d = np.subtract(w, self.target[:w.size], out=self._diff[:w.size])
            d *= self.lr
            w -= d

    def get(self) -> np.ndarray:
        return self.w

    def set(self, x: np.ndarray) -> None:
        self.w[...] = x

    def read_range(self, lo: int, hi: int) -> np.ndarray:
        return self.w[lo:hi]

    def write_range(self, lo: int, hi: int, values: np.ndarray) -> None:
        dst = self.w[lo:hi]
        if values.__array_interface__["data"][0] != dst.__array_interface__["data"][0]:
            dst[...] = values  # else the island changed the view `read` gave it


def _record_pushes(client, record) -> None:
    """Record when each push is handed to the client (encoded) and when the syncer's
    reply arrives (merged; the last push of a round replies after the commit)."""
    push = client.push

    def timed(payload, **kw):
        f = kw.get("fragment", 0)
        record("sent", seq=kw.get("seq"), fragment=f, bytes=len(payload))
        fut = push(payload, **kw)
        fut.add_done_callback(lambda _: record("replied", seq=kw.get("seq"), fragment=f))
        return fut

    client.push = timed


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m yeto.testing.synthetic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--syncer", required=True)
    p.add_argument("--learner-id", required=True)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--layout", choices=LAYOUTS, default="lora",
                   help="the tensors the --dim values form: a LoRA pair, or four tensors of "
                        "a full model")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--wire", default="q4")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--step-seconds", type=float, default=0.0,
                   help="sleep per step, before its update (pacing)")
    p.add_argument("--tokens", type=int, default=100, help="loss tokens per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--blocking-sync", action="store_true")
    p.add_argument("--stage-in-loop", action="store_true",
                   help="no guard before the update: each push is staged in the training "
                        "loop (the guard's baseline)")
    p.add_argument("--alternate-guard", action="store_true",
                   help="every other push staged in the training loop, the others behind "
                        "the guard (odd pushes: 1, 3, ...)")
    p.add_argument("--token", default=None)
    p.add_argument("--record", type=Path, default=None,
                   help="JSONL: one line per applied version with the weights' SHA-256")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level="INFO", format=f"%(asctime)s {args.learner_id} %(message)s")
    layout = layout_for(args.dim, args.layout)
    model = Quadratic(layout, args.seed, args.lr)

    def record(event: str, **kw) -> None:
        if args.record:
            with open(args.record, "a") as f:
                f.write(json.dumps(dict(event=event, learner=args.learner_id,
                                        time=time.time(), **kw)) + "\n")

    def on_apply(got) -> None:
        whole = isinstance(got.theta, np.ndarray)  # else it streamed into w
        record("applied", version=got.version, fragment=got.fragment, final=got.final,
               theta_sha256=hashlib.sha256(got.theta).hexdigest() if whole else None)

    def on_sync() -> float:
        record("push")
        return float("nan")

    client = connect(args.syncer, args.learner_id, layout, token=args.token,
                     backend="numpy", backoff_s=0.1, max_backoff_s=1.0)
    if args.record:
        _record_pushes(client, record)
    island = Island(model, client=client,
                    sync_every=args.sync_every, wire=args.wire, blocking=args.blocking_sync,
                    on_apply=on_apply, on_sync=on_sync if args.record else None,
                    connect_grace_s=30.0)
    if not args.stage_in_loop:
        island.guard_updates(lambda before_update: True)  # called before each update
    island.start()
    guarded = []
    for _ in range(args.steps):
        loss = model.gradient()
        if args.step_seconds:
            time.sleep(args.step_seconds)
        island.before_update()
        model.update()
        if args.alternate_guard:  # the guard for the next push when it is an odd one
            island.guard_updates(lambda before_update: island.pushes % 2 == 1)
        pushes = island.pushes
        over = island.after_step(args.tokens, train_loss=loss)
        guarded += [island.stager.deferred] * (island.pushes - pushes)
        if over:
            break
    island.finish()
    record("done", version=island.version, final=island.finished, step=island.step,
           weights_sha256=hashlib.sha256(model.w).hexdigest(), peak_rss_kib=peak_rss_kib(),
           cpu_s=sum(os.times()[:2]), blocked_s=island.blocked_s,
           encode_s=island.ledger.encode_s, stage_s=island.stager.stage_s, guarded=guarded)
    return 0


if __name__ == "__main__":
    sys.exit(main())
