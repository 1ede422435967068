"""The fleet-scale model: `python -m yeto.sim --islands 1000 --shards 1,4,16 --failures
0,0.01,0.05`.

A model, not a run: 1,000 synthetic islands (no weights, no gRPC, no syncer process)
over modelled links against S modelled syncer shards, on simulated seconds, under a
seeded trace of island crashes and slow-link episodes. For each failure rate and S it
runs the DiLoCo arm (`yeto.sim.diloco_model`: the real schedule, pipeline rule, pacing
(`syncer.pacing`), staleness limit and shard deal (`syncer.shards`)) and, once per
failure rate, synchronous data-parallel on the same fleet and trace
(`yeto.sim.sync_model`), and prints each arm's goodput: useful island-steps ÷
island-steps paid for (every island's time at its nominal speed, down or not).

Failures: `--failures R` is R crashes per island-hour of uptime (the island is down
`--restart-s`, then joins again) and R × `--slow-per-crash` slow-link episodes per
island-hour (`--slow-s` long, its bandwidth ÷ `--slow-factor`): one seeded trace per
rate, the same for both arms and every S. Useful island-steps: for DiLoCo, every inner
step not lost to a crash (merged, in a round, in flight, carried after a refusal, or
held at the end, which a finish would push; waste is time down, re-joining and stalled
on the pipeline, and the steps a crash loses); for synchronous data-parallel, one per
member of each completed step (waste is waiting for the slowest, a step cut by a
crash, detection and re-forms). The last RESULT line says whether DiLoCo's goodput is
at least 0.9 wherever synchronous data-parallel's is below 0.3.

What it leaves out: real shards (`python -m syncer --shard I/S`) are not run by this;
no loss is computed (the useful steps are assumed equally useful: stale pushes merged
late, a smaller group's batch, an island starting again from Θ all count alike); links
are bandwidth and latency without loss, congestion between islands or TCP dynamics;
the syncer's own failures and standbys; the outer step's and the save's time (they
are in the CPU per byte); a step's time varies by island, not by step.

The shards' cost per byte is measured, not assumed: `python scripts/bench_memory.py
--half-billion` (5e8 parameters, two islands, q4 up, f32 down; the run is in
BENCHMARKS.md): the syncer spent
2.80 CPU seconds a round (median) on 2 × 281,250,000 bytes of pushes in and 2 × 2e9
bytes of broadcast out, 0.614 ns per byte (1.63 GB per CPU second). That run's
syncer was 1.47–1.62× what raw gRPC and the arithmetic alone spend
(`syncer_over_stack`), so a leaner transport would move the shard's limit up: the
direct downlink (2026-12-06) cut the syncer's CPU a round by 21–36 % against gRPC's
broadcasts in alternating same-day pairs (BENCHMARKS.md, "The direct downlink against gRPC's"); the
figure above is the earlier one, kept (that day's machine ran the same arithmetic 1.7–2×
slower, so its absolute CPU per byte does not compare), which makes a shard's limit
here a conservative one. A shard's
NIC moves its bandwidth each way; its CPU moves cores ÷ CPU per byte, in and out
together.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

from yeto.sim.diloco_model import DiLoCoConfig, DiLoCoModel, DiLoCoOutcome
from yeto.sim.sync_model import SyncConfig, SyncModel, SyncOutcome
from yeto.sim.trace import HOUR, FailureTrace, Fleet

# measured (see the module docstring): syncer CPU seconds per byte in or out
SYNCER_CPU_S_PER_BYTE = 2.80 / (2 * 281_250_000 + 2 * 2_000_000_000)
GOAL_DILOCO, GOAL_SYNC_BELOW = 0.9, 0.3
GBIT = 1e9 / 8


@dataclass
class Point:
    """One failure rate and shard count: both arms' outcomes and the model's wall time."""

    failures: float
    shards: int
    diloco: DiLoCoOutcome
    sync: SyncOutcome
    wall_s: float

    @property
    def ratio(self) -> float:
        return self.diloco.goodput / self.sync.goodput if self.sync.goodput > 0 else math.inf


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the help; the description and epilog as written."""


def build_parser() -> argparse.ArgumentParser:
    """The model's flags. The help holds no measured figure (those are in BENCHMARKS.md
    and this module's docstring)."""
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(
        prog="python -m yeto.sim", description=doc[1], formatter_class=_Formatter,
        epilog="Example:\n  python -m yeto.sim --islands 1000 --shards 1,4,16 "
               "--failures 0,0.01,0.05\n\n" + "\n\n".join(doc[2:4]) + "\n\n"
               "--cpu-ns-per-byte's default is the syncer's CPU per byte in or out, measured\n"
               "by `python scripts/bench_memory.py --half-billion` (BENCHMARKS.md). A shard's\n"
               "NIC moves its bandwidth each way; its CPU moves cores ÷ CPU per byte, in and\n"
               "out together.")
    g = p.add_argument_group("the sweep")
    g.add_argument("--islands", type=int, default=1000, help="islands in the fleet")
    g.add_argument("--shards", type=_ints, default="1,4,16", metavar="S,...",
                   help="syncer shard counts to model (each needs --fragments >= S)")
    g.add_argument("--failures", type=_floats, default="0,0.01,0.05", metavar="R,...",
                   help="failure rates: island crashes per island-hour of uptime, and "
                        "slow-link episodes per island-hour times --slow-per-crash")
    g.add_argument("--hours", type=float, default=2.0, help="simulated hours per run")
    g.add_argument("--seed", type=int, default=0, help="seeds the fleet's speeds and the trace")
    g.add_argument("--markdown", action="store_true", help="print the table as markdown too")
    m = p.add_argument_group("the model and the run")
    m.add_argument("--params", type=_count, default=10**9, help="trainable parameters (f32)")
    m.add_argument("--fragments", type=int, default=16,
                   help="fragments (the syncer's --fragments)")
    m.add_argument("--sync-every", type=int, default=500, metavar="H",
                   help="inner steps between two pushes of a fragment")
    m.add_argument("--step-s", type=float, default=1.0, help="simulated seconds per inner step")
    m.add_argument("--speed-spread", type=float, default=0.1,
                   help="island i's step takes --step-s times a factor drawn from "
                        "[1, 1 + spread], fixed for the run")
    m.add_argument("--pipeline", type=int, default=0,
                   help="fragments an island may have in flight (the island's --pipeline; "
                        "0: --fragments)")
    m.add_argument("--downlink", choices=("f32", "bf16", "q4"), default="f32",
                   help="encoding of broadcasts (pushes are q4)")
    m.add_argument("--quorum", type=float, default=0.9,
                   help="share of the islands whose pushes commit a round (K = ceil(share × "
                        "islands), the syncer's --quorum)")
    m.add_argument("--grace", choices=("auto", "fixed"), default="auto")
    m.add_argument("--grace-ms", type=int, default=500)
    m.add_argument("--round-timeout-s", type=float, default=600.0)
    m.add_argument("--max-staleness", type=int, default=1)
    n = p.add_argument_group("links and shards")
    n.add_argument("--link-gbit", type=float, default=100.0,
                   help="each island's link, Gbit/s each way")
    n.add_argument("--latency-ms", type=float, default=5.0, help="each island's one-way latency")
    n.add_argument("--shard-nic-gbit", type=float, default=25.0,
                   help="each shard's NIC, Gbit/s each way")
    n.add_argument("--shard-cores", type=float, default=1.0,
                   help="cores each shard spends at the measured CPU per byte")
    n.add_argument("--cpu-ns-per-byte", type=float, default=SYNCER_CPU_S_PER_BYTE * 1e9,
                   help="shard CPU per byte in or out (measured; see above)")
    f = p.add_argument_group("failures")
    f.add_argument("--restart-s", type=float, default=600.0,
                   help="seconds a crashed island is down before it can join again")
    f.add_argument("--detect-s", type=float, default=20.0,
                   help="seconds until a crash is noticed (both arms)")
    f.add_argument("--reform-s", type=float, default=30.0,
                   help="seconds a data-parallel group takes to re-form after a crash "
                        "and to let a restarted island in")
    f.add_argument("--slow-per-crash", type=float, default=1.0,
                   help="slow-link episodes per crash (0: none)")
    f.add_argument("--slow-s", type=float, default=300.0, help="seconds a slow-link episode lasts")
    f.add_argument("--slow-factor", type=float, default=20.0,
                   help="a slow link's bandwidth is divided by this")
    f.add_argument("--grad-bytes-per-param", type=float, default=2.0,
                   help="data-parallel all-reduce bytes per parameter (2: bf16 gradients)")
    return p


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,4,16; got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1 like 1,4,16; got {text!r}")
    return out


def _floats(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected rates like 0,0.01,0.05; got {text!r}") \
            from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"expected rates >= 0 like 0,0.01,0.05; got {text!r}")
    return out


def _count(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count like 1e9; got {text!r}") from None
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"expected a whole count >= 1 like 1e9; got {text!r}")
    return int(value)


def check(args: argparse.Namespace) -> None:
    """Raise ValueError naming the flag for settings the model cannot run."""
    if args.islands < 1:
        raise ValueError("--islands must be at least 1")
    if max(args.shards) > args.fragments:
        raise ValueError(f"--shards {max(args.shards)} needs --fragments >= {max(args.shards)} "
                         f"(each shard owns whole fragments); got --fragments {args.fragments}")
    if not 0 < args.quorum <= 1:
        raise ValueError("--quorum is a share of the islands, in (0, 1]")
    for flag in ("hours", "step_s", "link_gbit", "shard_nic_gbit", "shard_cores", "restart_s",
                 "slow_factor"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0")
    for flag in ("speed_spread", "latency_ms", "cpu_ns_per_byte", "detect_s", "reform_s",
                 "slow_per_crash", "slow_s", "grad_bytes_per_param"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0")
    if args.slow_factor < 1:
        raise ValueError("--slow-factor must be >= 1 (a slow link is slower)")
    if args.pipeline < 0:
        raise ValueError("--pipeline must be >= 0 (0: every fragment)")


def fleet_of(args: argparse.Namespace) -> Fleet:
    return Fleet.uniform(args.islands, args.step_s, args.link_gbit * GBIT,
                         args.latency_ms / 1000, args.speed_spread, args.seed)


def trace_of(args: argparse.Namespace, rate: float) -> FailureTrace:
    return FailureTrace.draw(args.islands, args.hours * HOUR, rate, args.restart_s,
                             rate * args.slow_per_crash, args.slow_s, args.slow_factor,
                             seed=args.seed)


def diloco_config(args: argparse.Namespace, shards: int) -> DiLoCoConfig:
    return DiLoCoConfig(
        params=args.params, fragments=args.fragments, sync_every=args.sync_every,
        quorum=max(1, math.ceil(args.quorum * args.islands)), shards=shards,
        pipeline=args.pipeline or args.fragments, downlink=args.downlink, grace=args.grace,
        grace_ms=args.grace_ms, round_timeout_s=args.round_timeout_s,
        max_staleness=args.max_staleness, detect_s=args.detect_s,
        shard_nic_bps=args.shard_nic_gbit * GBIT, shard_cores=args.shard_cores,
        cpu_s_per_byte=args.cpu_ns_per_byte * 1e-9)


def sync_config(args: argparse.Namespace) -> SyncConfig:
    return SyncConfig(grad_bytes=int(args.grad_bytes_per_param * args.params),
                      detect_s=args.detect_s, reform_s=args.reform_s)


def sweep(args: argparse.Namespace) -> list[Point]:
    """Every failure rate × shard count, in that order; the synchronous arm once per rate."""
    fleet, seconds, points = fleet_of(args), args.hours * HOUR, []
    for rate in args.failures:
        trace = trace_of(args, rate)
        t0 = time.perf_counter()
        sync = SyncModel(sync_config(args), fleet, trace, seconds).run()
        sync_wall = time.perf_counter() - t0
        for s in args.shards:
            t0 = time.perf_counter()
            diloco = DiLoCoModel(diloco_config(args, s), fleet, trace, seconds).run()
            points.append(Point(rate, s, diloco, sync,
                                time.perf_counter() - t0 + sync_wall / len(args.shards)))
    return points


def report(args: argparse.Namespace, points: list[Point], wall_s: float) -> bool:
    """Print the table and the RESULT lines; True when the goal holds (DiLoCo's goodput
    >= 0.9 at every point where synchronous data-parallel's is below 0.3)."""
    seconds = args.hours * HOUR
    headers = ["failures /island-h", "S", "round s", "busiest shard GB in", "GB out",
               "CPU s", "CPU busy", "backlog s", "goodput DiLoCo", "goodput sync", "ratio",
               "model s"]
    rows = []
    for pt in points:
        d = pt.diloco
        busiest = max(range(pt.shards), key=lambda s: d.shard_cpu_s[s])
        rows.append([pt.failures, pt.shards, d.round_s, d.shard_bytes_in[busiest] / 1e9,
                     d.shard_bytes_out[busiest] / 1e9, d.shard_cpu_s[busiest],
                     f"{d.shard_cpu_s[busiest] / (args.shard_cores * seconds):.0%}",
                     d.shard_backlog_s[busiest],
                     f"{d.goodput:.3f}", f"{pt.sync.goodput:.3f}", f"{pt.ratio:.2f}",
                     f"{pt.wall_s:.1f}"])
    print(f"{args.islands} islands, {args.params:.3g} parameters in {args.fragments} "
          f"fragments, H = {args.sync_every}, {args.step_s:g} s a step "
          f"(+0–{args.speed_spread:.0%} by island), {args.hours:g} simulated hours; "
          f"links {args.link_gbit:g} Gbit/s, {args.latency_ms:g} ms; shards "
          f"{args.shard_nic_gbit:g} Gbit/s NIC, {args.shard_cores:g} core"
          f"{'' if args.shard_cores == 1 else 's'} at "
          f"{args.cpu_ns_per_byte:.3f} ns/byte (measured); crashes down {args.restart_s:g} s, "
          f"slow links ÷{args.slow_factor:g} for {args.slow_s:g} s")
    print(table_text(headers, rows))
    if args.markdown:
        print(table_text(headers, rows, markdown=True))
    for pt in points:
        d, s = pt.diloco, pt.sync
        print(f"RESULT failures={pt.failures:g} shards={pt.shards} round_s={d.round_s:.1f} "
              f"shard_gb_in={_join(b / 1e9 for b in d.shard_bytes_in)} "
              f"shard_gb_out={_join(b / 1e9 for b in d.shard_bytes_out)} "
              f"shard_cpu_s={_join(d.shard_cpu_s)} "
              f"shard_backlog_s={max(d.shard_backlog_s):.0f} "
              f"goodput_diloco={d.goodput:.3f} goodput_sync={s.goodput:.3f} "
              f"ratio={pt.ratio:.2f} lost_diloco={_waste(d)} lost_sync=stalled:"
              f"{s.stalled_s:.0f}s,steps_cut:{s.lost_steps:.0f} refused={d.refused} "
              f"commits={dict(d.commits)}")
    tested = [pt for pt in points if pt.sync.goodput < GOAL_SYNC_BELOW]
    met = bool(tested) and all(pt.diloco.goodput >= GOAL_DILOCO for pt in tested)
    short = [f"S={pt.shards}@{pt.failures:g}:{pt.diloco.goodput:.3f}" for pt in tested
             if pt.diloco.goodput < GOAL_DILOCO]
    met_at = [s for s in args.shards if tested and all(
        pt.diloco.goodput >= GOAL_DILOCO for pt in tested if pt.shards == s)]
    print(f"RESULT goal={'met' if met else 'not_met' if tested else 'untested'} "
          f"met_at_shards={','.join(map(str, met_at)) or 'none'} "
          f"(goodput_diloco >= {GOAL_DILOCO} where goodput_sync < {GOAL_SYNC_BELOW}: "
          f"{len(tested)} points{', short: ' + ' '.join(short) if short else ''}) "
          f"model_wall_s={wall_s:.1f}")
    return met


def table_text(headers: list[str], rows: list[list], markdown: bool = False) -> str:
    """`rows` as a plain table (columns two spaces apart, right-aligned, a rule under the
    header: the plain style of the `yeto` command's tables, which a library module does
    not import) or as a markdown table. Floats from 100 up get one decimal and thousands
    grouped, smaller ones three significant digits."""
    cells = [[str(h) for h in headers]] + [[_cell(c) for c in r] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(r) + " |" for r in cells]
        return "\n".join([lines[0], "|" + "---|" * len(headers), *lines[1:]])
    widths = [max(len(r[j]) for r in cells) for j in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def _cell(x) -> str:
    if isinstance(x, float):
        return f"{x:,.1f}" if abs(x) >= 100 else f"{x:.3g}"
    return str(x)


def _join(values) -> str:
    return ",".join(f"{v:.1f}" for v in values)


def _waste(d: DiLoCoOutcome) -> str:
    """DiLoCo's waste as shares of the steps paid for."""
    parts = dict(down=d.down_steps, rejoin=d.rejoin_steps, stalled=d.stalled_steps,
                 crash_lost=d.lost_steps)
    return ",".join(f"{k}:{v / d.paid_steps:.4f}" for k, v in parts.items())


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        check(args)
    except ValueError as e:
        p.error(str(e))
    t0 = time.perf_counter()
    points = sweep(args)
    report(args, points, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
