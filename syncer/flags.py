"""The outer loop's flags, shared by `python -m syncer` and `python -m yeto.sim`:
merge rule, outer step, grace, staleness, clipping, fragments, downlink. The defaults
are `syncer.run.Config`'s."""

from __future__ import annotations

import argparse
from typing import Any

from syncer.merge import MERGE_RULES
from syncer.run import Config
from syncer.strategy import OPTIMIZERS
from yeto import codec


def add_round_args(p: argparse._ActionsContainer) -> None:
    """Add the outer loop's flags to a parser or argument group."""
    p.add_argument("--outer", choices=tuple(OPTIMIZERS), default=Config.outer,
                   help="the outer optimizer, with --outer-lr and --outer-momentum. The "
                        "default, auto, follows what the islands train: for SFT it is "
                        "nesterov-warmup (plain averaging at round 1, Nesterov lr, mu from "
                        "round 21: short runs stay near averaging, long ones get momentum); "
                        "once a GRPO island (yeto rl) joins, plain averaging (lr 1, mu 0), "
                        "which --outer-lr and --outer-momentum do not change (chosen by "
                        "three-seed runs of each regime: BENCHMARKS.md, \"One outer rule "
                        "for every regime\"). Name a rule to keep it whatever joins: "
                        "nesterov-warmup; nesterov (m <- mu m + "
                        "g; step lr (g + mu m); lr 1, mu 0 is plain averaging); nesterov-bc "
                        "(its momentum term bias-corrected); nesterov-agree (between plain "
                        "averaging and lr, mu by the cosine of g and m); nesterov-restart (m "
                        "emptied when g points against it). Each rule, its source and its "
                        "arithmetic: syncer/strategy.py")
    p.add_argument("--outer-lr", type=float, default=Config.outer_lr,
                   help="outer learning rate (with --outer nesterov: 1 with momentum 0 is "
                        "plain averaging; with auto and warm-up: the rate reached at round "
                        "21)")
    p.add_argument("--outer-momentum", type=float, default=Config.outer_momentum,
                   help="outer Nesterov momentum (with --outer nesterov: lr 1, momentum 0 is "
                        "plain averaging)")
    p.add_argument("--merge", choices=MERGE_RULES, default=Config.merge,
                   help="mean = weighted by loss tokens; uniform; rda = norm-preserving mean")
    p.add_argument("--grace-ms", type=int, default=Config.grace_ms,
                   help="after K pushes, wait this long for stragglers before committing "
                        "(with --grace auto: until the islands' pace is measured)")
    p.add_argument("--grace", choices=("fixed", "auto"), default=Config.grace,
                   help="auto: wait for a straggler only while its measured arrival is "
                        "worth more tokens than the pushers lose waiting (syncer/grace.py; "
                        "--grace-ms until each island has pushed twice); fixed: always "
                        "--grace-ms (BENCHMARKS.md, \"A mixed-speed fleet and the grace "
                        "window\")")
    p.add_argument("--round-timeout-s", type=float, default=Config.round_timeout_s,
                   help="commit with whatever arrived this long after a round's first push")
    p.add_argument("--max-staleness", type=int, default=Config.max_staleness,
                   help="accept late pushes up to this many versions old into the open round")
    p.add_argument("--clip-factor", type=float, default=Config.clip_factor,
                   help="clip each push's norm to this multiple of the round's median norm "
                        "(0 = off); pushes are then kept as received (large ones in their "
                        "spill files) until the round commits")
    p.add_argument("--fragments", type=int, default=Config.fragments, metavar="P",
                   help="cut the weights into P fragments synced in turn (Streaming DiLoCo): "
                        "each round moves about 1/P of the bytes")
    p.add_argument("--downlink", choices=codec.ENCODINGS, default=Config.downlink,
                   help="encoding of broadcast updates; islands hold bit-identical weights "
                        "either way, and the final weights always go out in f32")


def outer_args(outer: str | None, lr: float | None, momentum: float | None) -> list[str]:
    """The syncer's flags for the outer rule a launcher was given (None: the syncer's
    default), for the programs that start a syncer (`yeto demo`, `yeto demo --rl`)."""
    return [a for flag, value in (("--outer", outer), ("--outer-lr", lr),
                                  ("--outer-momentum", momentum))
            if value is not None for a in (flag, str(value))]


def round_config(args: argparse.Namespace, **run: Any) -> Config:
    """The run's `Config` from the outer loop's flags; `run` gives the rest (quorum,
    rounds, state dir, ...)."""
    return Config(outer=args.outer, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                  merge=args.merge, grace_ms=args.grace_ms, grace=args.grace,
                  round_timeout_s=args.round_timeout_s, max_staleness=args.max_staleness,
                  clip_factor=args.clip_factor, downlink=args.downlink,
                  fragments=max(1, args.fragments), **run)
