"""Soak: many synthetic islands for many rounds against one real syncer.

A real syncer runs in its own process (`python -m syncer --quorum N`); N
`SyncerClient` islands (threads here, one gRPC channel each) push a q4
pseudo-gradient every round and wait for the broadcast. Measured: errors (any
exception or missed broadcast; goal 0), the syncer's resident memory at round 10
and at the last round (goal: flat, growth ratio ~1), and rounds per second.

Last line: RESULT errors=<n> mem_growth=<rss_last / rss_round10> rounds_per_s=<x>
"""

from __future__ import annotations

import logging
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

# _bench (scripts/) puts the repo root on sys.path before yeto/syncer are imported
from _bench import ROOT, parser, result_line

from syncer.spawn import start_syncer
from yeto import codec
from yeto.client import SyncerClient
from yeto.layout import Layout


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def main(argv=None) -> int:
    p = parser(__doc__, quick="16 islands x 25 rounds (under a minute)")
    p.add_argument("--islands", type=int, default=32)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--params", type=int, default=1 << 18, help="parameters per island")
    args = p.parse_args(argv)
    if args.quick:
        args.islands, args.rounds = min(args.islands, 16), min(args.rounds, 25)
    logging.basicConfig(level=logging.ERROR)
    layout = Layout.from_shapes({"soak.layers.0.lora_A.weight": (args.params,)})
    errors: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        syncer = start_syncer(["--quorum", str(args.islands), "--grace-ms", "0", "--state-dir",
                               f"{tmp}/s", "--log-level", "WARNING"],
                              cwd=ROOT, log=Path(tmp) / "log")
        addr = syncer.address
        rss: dict[int, int] = {}
        barrier = threading.Barrier(args.islands)
        t_start = [0.0]

        def island(i: int) -> None:
            rng = np.random.default_rng(i)
            c = SyncerClient(addr, f"soak-{i:02d}", layout, backoff_s=0.05)
            c.start(np.zeros(layout.numel, np.float32))
            try:
                if c.wait_one(timeout=120) is None:
                    raise RuntimeError("no first broadcast")
                barrier.wait()
                if i == 0:
                    t_start[0] = time.perf_counter()
                for r in range(args.rounds):
                    d = rng.standard_normal(layout.numel).astype(np.float32) * 1e-3
                    c.push(codec.encode(d, "q4"), encoding="q4", base_version=r, loss_tokens=100,
                           steps=10, seq=r).result(timeout=120)
                    got = c.wait_one(timeout=120)
                    if got is None or got.version != r + 1:
                        raise RuntimeError(f"round {r + 1}: got {got and got.version}")
                    if i == 0 and r + 1 in (10, args.rounds):
                        rss[r + 1] = rss_kb(syncer.pid)
            except Exception as e:  # noqa: BLE001 - every failure counts as an error
                errors.append(f"soak-{i:02d}: {e!r}")
            finally:
                c.close()

        threads = [threading.Thread(target=island, args=(i,)) for i in range(args.islands)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t_start[0]
        syncer.stop(term_timeout_s=30)
    growth = rss.get(args.rounds, 0) / max(rss.get(10, 1), 1)
    print(f"{args.islands} islands x {args.rounds} rounds of {args.params:,} q4 parameters")
    print(f"errors: {len(errors)}  syncer RSS round 10: {rss.get(10, 0) / 1024:.1f} MiB, "
          f"round {args.rounds}: {rss.get(args.rounds, 0) / 1024:.1f} MiB  "
          f"rounds/s: {args.rounds / elapsed:.2f}")
    for e in errors[:5]:
        print("  ", e)
    print(result_line(errors=len(errors), mem_growth=growth, rounds_per_s=args.rounds / elapsed,
                      islands=args.islands, rounds=args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
