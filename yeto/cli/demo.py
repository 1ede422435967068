"""`yeto demo`: a complete local federated run on a tiny model built here.

Builds the tiny model and the synthetic task, then runs a syncer and the islands
as local processes through `yeto.cli.launch` (live display, dashboard, Ctrl-C stops
cleanly), and writes into --out:
  model/ data/           the base model and train/eval JSONL
  adapter/               the syncer's final adapter (peft format)
  islands/<id>/adapter/  each island's final adapter (bit-identical to adapter/)
  islands/<id>/log.txt   each island's log
  syncer/tape.jsonl      one line per merge
  summary.json           eval_loss_before/after, rounds, bytes_up/down, seconds

`yeto demo --rl` is the reinforcement-learning demo instead (`yeto.rl.demo`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

log = logging.getLogger("yeto.cli.demo")


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
    p.add_argument("--outer", default=None,
                   help="the syncer's outer rule (default: the syncer's, auto: nesterov-warmup "
                        "for SFT)")
    p.add_argument("--outer-lr", type=float, default=None,
                   help="the rule's learning rate (default: the syncer's)")
    p.add_argument("--outer-momentum", type=float, default=None,
                   help="the rule's momentum (default: the syncer's)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--extra", default="", help="extra flags passed to every island")
    p.add_argument("--display", choices=("auto", "live", "plain", "none"), default="auto",
                   help="live: a table redrawn in place; plain: a line per round")
    p.add_argument("--no-dashboard", action="store_true",
                   help="do not serve the syncer's dashboard")
    p.add_argument("--rl", action="store_true",
                   help="the RL demo instead: SFT warm start, then GRPO with a syncer, a GRPO "
                        "island and two rollout nodes (torch + MLX); its own flags: "
                        "`yeto demo --rl --help`")
    return p


def _config(args, out: Path, backends: list[str]):
    """The tiny model and task built in OUT, and the local run over them."""
    from syncer.flags import outer_args
    from yeto.cli.local_run import LaunchConfig
    from yeto.testing.tasks import make_task
    from yeto.testing.tiny import make_tiny_model

    print(f"building the tiny {args.arch} model and the task in {out} ...", flush=True)
    model = make_tiny_model(out / "model", arch=args.arch)
    train, held_out = make_task(out / "data")
    return LaunchConfig(
        out=out, backends=backends, model=str(model), data=str(train), eval_data=str(held_out),
        island_args=["--max-steps", str(args.max_steps), "--sync-every", str(args.sync_every),
                     "--wire", args.wire, "--inner-lr", str(args.inner_lr),
                     "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
                     "--lora-r", str(args.lora_r), "--seed", "0", *args.extra.split()],
        backend_args={"torch": ["--threads", "1"]},
        syncer_args=outer_args(args.outer, args.outer_lr, args.outer_momentum),
        dashboard_port=None if args.no_dashboard else 0, display=args.display,
        max_steps=args.max_steps, overwrite=True)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--rl" in argv:  # its own flags and defaults (yeto.rl.demo)
        from yeto.rl.demo import main as rl_demo

        return rl_demo([a for a in argv if a != "--rl"])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level="INFO", format="%(message)s")
    from yeto.backends import BACKENDS
    from yeto.cli.launch import run_local
    from yeto.cli.launch_view import Display
    from yeto.cli.local_run import LaunchError
    from yeto.io import atomic_write

    t0 = time.monotonic()
    out = args.out.resolve()
    backends = [b.strip() for b in args.islands.split(",") if b.strip()]
    bad = [b for b in backends if b not in BACKENDS]
    if not backends or bad:
        sys.exit(f"error: --islands {args.islands!r}: use a comma list of "
                 f"{', '.join(BACKENDS)}, e.g. --islands torch,mlx")
    cfg = _config(args, out, backends)
    display = Display(cfg.display)
    try:
        code, run, summary = run_local(
            cfg, display, on_started=lambda run: display.say(
                f"{len(backends)} islands started, {args.max_steps} steps, sync every "
                f"{args.sync_every}"))
    except LaunchError as e:
        print(f"error: {e}", flush=True)
        return 1
    if code == 1:
        failed = [i.id for i in run.islands if i.code]
        print(f"error: {', '.join(failed) or 'the syncer'} failed; see "
              f"{out}/islands/<id>/log.txt", flush=True)
        return 1
    if summary is None or not (out / "adapter").is_dir():
        print(f"error: the syncer wrote no final adapter; see {out}/syncer/log.txt")
        return 1
    summary["seconds"] = round(time.monotonic() - t0, 1)
    atomic_write(out / "summary.json", json.dumps(summary, indent=2))
    print(f"\nheld-out loss: {summary['eval_loss_before']:.4f} -> {summary['eval_loss_after']:.4f}"
          f"  ({summary['rounds']} rounds, {summary['bytes_up'] / 1e6:.2f} MB up, "
          f"{summary['bytes_down'] / 1e6:.2f} MB down, {summary['seconds']:.0f} s)")
    print(f"final adapter: {out / 'adapter'}  (load with peft.PeftModel.from_pretrained)")
    return 130 if code == 130 else 0

