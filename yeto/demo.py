"""`yeto demo`: a complete local federated run on a tiny model built here.

Builds the tiny model and the synthetic task, starts a syncer and the islands as
local processes, trains, and writes into --out:
  model/ data/           the base model and train/eval JSONL
  adapter/               the syncer's final adapter (peft format)
  islands/<id>/adapter/  each island's final adapter (bit-identical to adapter/)
  islands/<id>/log.txt   each island's log
  syncer/tape.jsonl      one line per merge
  summary.json           eval_loss_before/after, rounds, bytes_up/down, seconds
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger("yeto.demo")

ISLAND_MODULES = {"torch": "yeto.learner", "mlx": "yeto.mlx.learner"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="yeto demo", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="A local federated run: tiny model + synthetic task, a syncer and "
                    "islands as local processes; prints held-out loss before and after.")
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="output folder")
    p.add_argument("--islands", default="torch,torch",
                   help="comma list of island backends (torch, mlx)")
    p.add_argument("--arch", default="llama", help="tiny model architecture")
    p.add_argument("--max-steps", type=int, default=200, help="optimizer steps per island")
    p.add_argument("--sync-every", type=int, default=20, help="steps between pushes")
    p.add_argument("--wire", default="q4", choices=("q4", "bf16", "f32"))
    p.add_argument("--inner-lr", type=float, default=3e-3)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--extra", default="", help="extra flags passed to every island")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level="INFO", format="%(message)s")
    from yeto.fixtures import make_task, make_tiny_model

    t0 = time.monotonic()
    out = args.out.resolve()
    backends = [b.strip() for b in args.islands.split(",") if b.strip()]
    bad = [b for b in backends if b not in ISLAND_MODULES]
    if not backends or bad:
        sys.exit(f"error: --islands {args.islands!r}: use a comma list of "
                 f"{', '.join(ISLAND_MODULES)}, e.g. --islands torch,mlx")
    for sub in ("adapter", "islands", "syncer"):
        shutil.rmtree(out / sub, ignore_errors=True)
    print(f"building the tiny {args.arch} model and the task in {out} ...", flush=True)
    model = make_tiny_model(out / "model", arch=args.arch)
    train, held_out = make_task(out / "data")

    (out / "syncer").mkdir(parents=True)
    port_file = out / "syncer" / "port"
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    syncer_log = open(out / "syncer" / "log.txt", "w")
    syncer = subprocess.Popen(
        [sys.executable, "-m", "syncer", "--port", "0", "--port-file", str(port_file),
         "--quorum", str(len(backends)), "--state-dir", str(out / "syncer"),
         "--outer-lr", str(args.outer_lr), "--outer-momentum", str(args.outer_momentum)],
        stdout=syncer_log, stderr=subprocess.STDOUT, env=env)
    procs = []
    try:
        port = _wait_for_port(port_file, syncer)
        print(f"syncer on 127.0.0.1:{port}; starting {len(backends)} islands "
              f"({', '.join(backends)}), {args.max_steps} steps, sync every {args.sync_every}",
              flush=True)
        for i, backend in enumerate(backends):
            iid = f"island-{i}"
            d = out / "islands" / iid
            d.mkdir(parents=True)
            cmd = [sys.executable, "-m", ISLAND_MODULES[backend], "--model", str(model),
                   "--data", str(train), "--eval-data", str(held_out),
                   "--syncer", f"127.0.0.1:{port}", "--learner-id", iid,
                   "--num-learners", str(len(backends)), "--max-steps", str(args.max_steps),
                   "--sync-every", str(args.sync_every), "--wire", args.wire,
                   "--inner-lr", str(args.inner_lr), "--seq-len", str(args.seq_len),
                   "--batch-size", str(args.batch_size), "--lora-r", str(args.lora_r),
                   "--output", str(d), "--no-progress", "--seed", "0", *args.extra.split()]
            if backend == "torch":
                cmd += ["--threads", "1"]
            procs.append(subprocess.Popen(cmd, stdout=open(d / "log.txt", "w"),
                                          stderr=subprocess.STDOUT, env=env))
        _follow(out / "syncer" / "tape.jsonl", procs)
        codes = [p.wait() for p in procs]
        syncer.wait(timeout=60)
    finally:
        for p in procs + [syncer]:
            if p.poll() is None:
                p.terminate()
    if any(codes):
        failed = [f"island-{i}" for i, c in enumerate(codes) if c]
        print(f"error: {', '.join(failed)} failed; see {out}/islands/<id>/log.txt", flush=True)
        return 1
    final = out / "syncer" / "final"
    if not final.exists():
        print(f"error: the syncer wrote no final adapter; see {out}/syncer/log.txt")
        return 1
    shutil.copytree(final, out / "adapter")
    summary = summarize(out, time.monotonic() - t0)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\nheld-out loss: {summary['eval_loss_before']:.4f} -> {summary['eval_loss_after']:.4f}"
          f"  ({summary['rounds']} rounds, {summary['bytes_up'] / 1e6:.2f} MB up, "
          f"{summary['bytes_down'] / 1e6:.2f} MB down, {summary['seconds']:.0f} s)")
    print(f"final adapter: {out / 'adapter'}  (load with peft.PeftModel.from_pretrained)")
    return 0


def summarize(out: Path, seconds: float) -> dict:
    from syncer.tape import read_tape

    merges = [r for r in read_tape(out / "syncer" / "tape.jsonl") if r.get("event") == "merge"]
    islands = {d.name: json.loads((d / "summary.json").read_text())
               for d in sorted((out / "islands").iterdir())}
    first = next(iter(islands.values()))
    return dict(eval_loss_before=first["eval_loss_before"], eval_loss_after=first["eval_loss"],
                rounds=len(merges), bytes_up=sum(r["bytes_in"] for r in merges),
                bytes_down=sum(r["bytes_out"] for r in merges), seconds=round(seconds, 1),
                islands={k: dict(eval_loss=v["eval_loss"], loss_tokens=v["loss_tokens"],
                                 final=v["final"]) for k, v in islands.items()})


def _wait_for_port(port_file: Path, proc, timeout: float = 60) -> int:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if port_file.exists():
            return int(port_file.read_text())
        if proc.poll() is not None:
            raise SystemExit(f"error: the syncer exited with code {proc.returncode}; see its log")
        time.sleep(0.05)
    raise SystemExit("error: the syncer did not start listening within 60 s")


def _follow(tape: Path, procs) -> None:
    """Print one line per merged round while the islands train."""
    seen = 0
    while True:
        alive = any(p.poll() is None for p in procs)
        if tape.exists():
            lines = tape.read_text().splitlines()
            for line in lines[seen:]:
                r = json.loads(line)
                if r.get("event") == "merge":
                    parts = [f"{x['learner']} {x['tokens']} tok"
                             + (f" eval {x['eval_loss']:.3f}" if x.get("eval_loss") else "")
                             for x in r["responders"]]
                    print(f"round {r['round']:3d}: " + ", ".join(parts), flush=True)
            seen = len(lines)
        if not alive:
            return
        time.sleep(0.5)
