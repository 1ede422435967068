"""What sharding the syncer buys: the same run served by S = 1 and by S shards
(`python -m syncer --shard I/S`), measured in one invocation.

Each arm starts its syncers and the same synthetic numpy islands (`python -m
yeto.testing.synthetic`: a real `Island` and client, no model) with the same seeds, steps
and schedule, and reports per shard: CPU seconds (utime + stime, read from
/proc/PID/stat until it exits), bytes in and out (its state's counters), peak RSS
(VmHWM: the seed arrives whole at every shard, so the peak holds all of Θ once) and the
most RSS once its rounds run (VmRSS after its first merge: a shard keeps only its own
fragments' values), and for the
arm: wall seconds from the islands' start to their end, and rounds. Baseline: S = 1
in the same run. Islands, syncers and this script share the machine: on 2 cores the
wall time says little (everything competes for the same CPUs); the per-shard CPU and
bytes are what moves across machines with S.

    .venv/bin/python scripts/bench_shards.py                 # 2 islands, 2e7 values, S = 1, 2
    .venv/bin/python scripts/bench_shards.py --quick         # a smoke run

Last line: RESULT ratio=<busiest shard's CPU at S / the one syncer's CPU at S = 1> ...
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _bench import ROOT, parser, proc_cpu_s, proc_kib, result_line

from syncer import spawn, state
from syncer.tape import read_tape
from yeto.display import print_table

SIM = [sys.executable, "-m", "yeto.testing.synthetic"]


def merged(state_dir: Path) -> bool:
    """Whether the shard's tape holds a merge yet (its seed is in, its rounds run)."""
    try:
        return '"event": "merge"' in (state_dir / "tape.jsonl").read_text()
    except OSError:
        return False


def arm(shards: int, args, out: Path) -> dict:
    """One run served by `shards` syncers; its figures."""
    out.mkdir(parents=True)
    syncers = []
    for i in range(shards):
        with open(out / f"shard{i}.log", "w") as log:
            syncers.append(spawn.start_syncer(
                ["--state-dir", str(out / f"shard{i}"), "--shard", f"{i}/{shards}",
                 "--fragments", str(args.fragments), "--quorum", str(args.islands),
                 "--seed-from", "island-0"], cwd=ROOT, log=log))
    address = ";".join(s.address for s in syncers) if shards > 1 else syncers[0].address
    t0 = time.perf_counter()
    islands = [subprocess.Popen([*SIM, "--syncer", address, "--learner-id", f"island-{i}",
                                 "--steps", str(args.steps), "--sync-every",
                                 str(args.sync_every), "--dim", str(args.dim), "--seed", str(i),
                                 "--wire", args.wire], cwd=ROOT,
                                stdout=open(out / f"island-{i}.log", "w"),
                                stderr=subprocess.STDOUT) for i in range(args.islands)]
    cpu, peak, rss = [0.0] * shards, [0] * shards, [0] * shards
    islands_done = None
    try:
        while any(p.poll() is None for p in islands) or any(s.poll() is None for s in syncers):
            for i, s in enumerate(syncers):
                now, hwm = proc_cpu_s(s.pid), proc_kib(s.pid, "VmHWM")
                cpu[i] = now if now is not None else cpu[i]
                peak[i] = hwm if hwm is not None else peak[i]
                if islands_done is None and merged(out / f"shard{i}"):  # rounds running
                    rss[i] = max(rss[i], proc_kib(s.pid, "VmRSS") or 0)
            if islands_done is None and all(p.poll() is not None for p in islands):
                islands_done = time.perf_counter()
            if islands_done is not None and time.perf_counter() - islands_done > 60:
                break  # the islands are gone: a syncer still up after a minute is stuck
            time.sleep(0.1)
        wall = (islands_done or time.perf_counter()) - t0
    finally:
        for p in [*islands, *syncers]:
            if p.poll() is None:
                p.kill()
    bad = [i for i, p in enumerate(islands) if p.returncode != 0]
    if bad:
        raise SystemExit(f"islands {bad} failed: see {out}/island-*.log")
    rows = []
    for i in range(shards):
        meta = state.load(out / f"shard{i}")[3]
        merges = [r for r in read_tape(out / f"shard{i}" / "tape.jsonl") if r["event"] == "merge"]
        rows.append(dict(cpu_s=cpu[i], bytes_in=meta["bytes_in"], bytes_out=meta["bytes_out"],
                         rounds=len(merges), peak_mib=peak[i] / 1024,
                         rss_mib=rss[i] / 1024))
    return dict(wall_s=wall, shards=rows)


def main(argv=None) -> int:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--islands", type=int, default=2)
    p.add_argument("--dim", type=int, default=20_000_000, help="values in Θ")
    p.add_argument("--fragments", type=int, default=2,
                   help="the synthetic island's layout has two tensors: at most 2")
    p.add_argument("--shards", default="1,2", help="comma list; the first is the baseline")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--wire", default="q4")
    args = p.parse_args(argv)
    if args.quick:
        args.dim, args.steps, args.sync_every = 1_000_000, 10, 5
    counts = [int(x) for x in args.shards.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-shards-") as tmp:
        results = {s: arm(s, args, Path(tmp) / f"s{s}") for s in counts}
    table = []
    for s, r in results.items():
        for i, row in enumerate(r["shards"]):
            table.append([str(s), str(i), f"{r['wall_s']:.1f}", str(row["rounds"]),
                          f"{row['cpu_s']:.1f}", f"{row['bytes_in'] / 1e6:.1f}",
                          f"{row['bytes_out'] / 1e6:.1f}", f"{row['peak_mib']:.0f}",
                          f"{row['rss_mib']:.0f}"])
    print_table(["S", "shard", "wall s", "rounds", "CPU s", "MB in", "MB out", "peak RSS MiB",
                 "RSS in rounds MiB"], table)
    base = results[counts[0]]
    base_cpu = max(r["cpu_s"] for r in base["shards"])
    for s in counts[1:]:
        r = results[s]
        busiest = max(x["cpu_s"] for x in r["shards"])
        base_peak = max(x["peak_mib"] for x in base["shards"])
        print(result_line(busiest / base_cpu, shards=s, baseline_shards=counts[0],
                          busiest_cpu_s=busiest, baseline_cpu_s=base_cpu,
                          largest_peak_ratio=max(x["peak_mib"] for x in r["shards"]) / base_peak,
                          largest_rss_ratio=max(x["rss_mib"] for x in r["shards"]) /
                          max(x["rss_mib"] for x in base["shards"]),
                          wall_ratio=r["wall_s"] / base["wall_s"],
                          max_bytes_in_share=max(x["bytes_in"] for x in r["shards"]) /
                          sum(x["bytes_in"] for x in base["shards"])))
    print(json.dumps({s: r for s, r in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
