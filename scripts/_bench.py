"""Shared helpers for the benchmark scripts (scripts/bench_*.py).

Every benchmark measures its baseline in the same run as the thing it measures,
prints a short table (`yeto.display.print_table`), and ends with one
machine-readable line (`result_line`):

    RESULT ratio=<value> key=value ...

(a benchmark whose headline is not one ratio leaves ``ratio`` out: `RESULT key=value ...`).

Nothing here asserts a speed: the numbers are for people (and CI logs) to read.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python scripts/bench_x.py` from anywhere
    sys.path.insert(0, str(ROOT))

MIB = 1 << 20


QUICK = ("fewer repeats (and smaller sizes where noted); finishes in well under 30 s, for "
         "tests and smoke checks")


def parser(description: str, epilog: str = "", quick: str = QUICK) -> argparse.ArgumentParser:
    """A benchmark's arguments: its docstring as the help, and --quick (`quick`: what
    it makes smaller)."""
    p = argparse.ArgumentParser(description=description, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=quick)
    return p


def timeit(fn, repeat: int, setup=None) -> float:
    """Best wall time of `repeat` calls (after `setup()` each time, untimed)."""
    best = math.inf
    for _ in range(max(1, repeat)):
        if setup is not None:
            setup()
        gc.collect()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def interleaved(fns: dict, repeat: int) -> dict:
    """Best time of each function, measured round-robin so that load from other
    processes on a shared machine hits the baseline and the candidate alike."""
    best = {k: math.inf for k in fns}
    for _ in range(max(1, repeat)):
        for k, fn in fns.items():
            gc.collect()
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def rate(nbytes: float, seconds: float) -> float:
    """Bytes per second in MiB/s."""
    return nbytes / MIB / seconds if seconds > 0 else math.inf


def result_line(ratio: float | None = None, **kv) -> str:
    """`RESULT ratio=<ratio> key=value ...` (without a ratio: `RESULT key=value ...`), in
    the order given; floats to 4 significant digits, spaces in values as underscores."""
    items = ({"ratio": ratio} if ratio is not None else {}) | kv
    return "RESULT " + " ".join(f"{k}={_num(v)}" for k, v in items.items())


def _num(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace(" ", "_")


# ---- /proc ------------------------------------------------------------------------
def proc_kib(pid: int, field: str) -> int | None:
    """A `VmRSS`/`VmHWM` line of /proc/PID/status in KiB (None once the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process (/proc/PID/stat; None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
