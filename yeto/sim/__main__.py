"""`python -m yeto.sim`: a DiLoCo fleet (a syncer and k islands) in one process.

Runs k torch islands over the project's own code — island state machine, codec
with error feedback, merge rules, outer optimizer, tape — through an in-process
transport instead of gRPC, so runs of hundreds of rounds fit on a small machine.
The flags are the islands' (`python -m yeto.learner --help`) and the syncer's
(`python -m syncer --help`) plus the fleet's own.

    python -m yeto.sim --model runs/demo/model --data runs/demo/data/train.jsonl \\
        --eval-data runs/demo/data/eval.jsonl --islands 4 --sync-every 50 --rounds 100 \\
        --out runs/sim

Last line: `RESULT eval_loss=… bytes_up=… bytes_down=… rounds=…`.

`--syncer-shards S` serves the run by S real syncer shards in the process (real time).
With `--shards` or `--failures` it runs the fleet-scale model instead (`yeto.sim.scale`:
1,000 synthetic islands against S modelled syncer shards under crashes and slow links,
DiLoCo's goodput beside synchronous data-parallel's; its flags:
`python -m yeto.sim --shards 1 --help`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from syncer.__main__ import build_parser as syncer_parser
from syncer.flags import add_round_args, round_config
from syncer.run import Config
from yeto import runfile
from yeto.config import ConfigError, IslandConfig, add_island_args, island_parser


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m yeto.sim", description=__doc__.split("\n\n")[1],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Example:\n  python -m yeto.sim --model runs/demo/model --data "
               "runs/demo/data/train.jsonl --eval-data runs/demo/data/eval.jsonl "
               "--islands 4 --sync-every 50 --rounds 100 --out runs/sim")
    add_island_args(p)
    p.add_argument("--tuning", choices=("lora", "full"), default="lora")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per island")
    fleet = p.add_argument_group("the fleet")
    fleet.add_argument("--islands", type=int, default=2, metavar="K", help="islands in the fleet")
    fleet.add_argument("--rounds", type=int, default=0, metavar="R",
                       help="outer rounds: each island trains R x --sync-every steps "
                            "(0: --max-steps decides)")
    fleet.add_argument("--speeds", default=None,
                       help="comma list, one per island: step time multipliers (1 = full "
                            "speed, 3 = three times slower) for a mixed-speed fleet; an "
                            "island at speed s trains --max-steps / s steps, so all train "
                            "for the same wall time")
    fleet.add_argument("--step-seconds", type=float, default=0.0, metavar="S",
                       help="run on simulated time: a step at speed s costs s x S simulated "
                            "seconds, nobody sleeps, and --speeds, --sync-every-seconds and "
                            "the syncer's grace window and timeouts count simulated seconds "
                            "(islands take turns: the one whose step ends first goes next). "
                            "0: real time (a slow island sleeps)")
    fleet.add_argument("--step-jitter", type=float, default=0.0, metavar="J",
                       help="on simulated time: each step costs its S x s times a factor "
                            "drawn uniformly from [1 - J, 1 + J] (seeded per island, so a "
                            "run repeats exactly), as real steps vary; without it islands "
                            "of equal speed push at the same instant")
    fleet.add_argument("--syncer-shards", type=int, default=1, metavar="S",
                       help="serve the run by S syncer shards, each a syncer in this process "
                            "owning some fragments (as python -m syncer --shard I/S; "
                            "--fragments at least S, island-0 seeds them all, state in "
                            "OUT/syncer-I): each island pushes each fragment to its owner. "
                            "Real time only. (--shards runs the fleet-scale model instead)")
    fleet.add_argument("--out", type=Path, default=Path("runs/sim"), help="output folder")
    _add_syncer_args(p.add_argument_group("the syncer (python -m syncer --help)"))
    return p


def _add_syncer_args(g) -> None:
    g.add_argument("--quorum", type=int, default=None, help="default: every island")
    add_round_args(g)


def configs(args: argparse.Namespace) -> tuple[IslandConfig, Config, list[float]]:
    """The islands' base config, the syncer's config and the speeds, checked."""
    if args.islands < 1:
        raise ConfigError("--islands must be at least 1")
    if args.rounds:
        args.max_steps = args.rounds * args.sync_every
    speeds = [float(x) for x in args.speeds.split(",")] if args.speeds else []
    if args.step_seconds < 0:
        raise ConfigError("--step-seconds must be >= 0 (0: real time)")
    if not 0 <= args.step_jitter < 1:
        raise ConfigError("--step-jitter must be in [0, 1): a step's cost varies by that "
                          "share either way")
    if args.step_jitter and not args.step_seconds:
        raise ConfigError("--step-jitter needs --step-seconds (simulated time)")
    if args.syncer_shards < 1:
        raise ConfigError("--syncer-shards must be at least 1")
    if args.syncer_shards > 1 and args.step_seconds:
        raise ConfigError("--syncer-shards runs on real time: drop --step-seconds")
    if speeds and len(speeds) != args.islands:
        raise ConfigError(f"--speeds has {len(speeds)} values for {args.islands} islands")
    base = IslandConfig.from_args(args)
    base.num_learners = args.islands
    base.check()
    if not 1 <= (args.quorum or args.islands) <= args.islands:
        raise ConfigError(f"--quorum must be between 1 and --islands ({args.islands})")
    syncer = round_config(args, quorum=args.quorum or args.islands)
    return base, syncer, speeds


def wants_scale_model(argv: list[str]) -> bool:
    """Whether the command line asks for the fleet-scale model (`--shards`, `--failures`)."""
    return any(a.split("=", 1)[0] in ("--shards", "--failures") for a in argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if wants_scale_model(argv):
        from yeto.sim import scale

        return scale.main(argv)
    p = build_parser()
    args = runfile.parse(p, argv, "sim",
                         programs={"island": island_parser, "syncer": syncer_parser})
    try:
        base, syncer, speeds = configs(args)
    except ConfigError as e:
        p.error(str(e))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(threadName)s "
                        "%(message)s", datefmt="%H:%M:%S")
    from yeto.sim.fleet import run_fleet

    r = run_fleet(base, syncer, args.islands, args.out, speeds, args.step_seconds,
                  args.step_jitter, args.syncer_shards)
    simulated = f" ({r.simulated_s:.1f} simulated)" if args.step_seconds else ""
    print(f"{args.islands} islands, {r.rounds} rounds in {r.seconds:.0f} s{simulated}: held-out "
          f"loss {r.eval_loss_before:.4f} -> {r.eval_loss:.4f}; outputs in {args.out}")
    if r.goodput:
        print("goodput (share of simulated time spent training): " +
              ", ".join(f"{i} {g:.3f}" for i, g in r.goodput.items()))
    print(f"RESULT eval_loss={r.eval_loss:.6f} bytes_up={r.bytes_up} bytes_down={r.bytes_down} "
          f"rounds={r.rounds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
