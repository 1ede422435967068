"""Syncer memory during a round of 16 pushes, against one fragment's f32 size.

What is measured: a real syncer runs in its own process (`python -m syncer
--quorum 16 --grace-ms 0`), so the islands' memory does not count. Sixteen
`yeto.client.SyncerClient` islands (threads of this process, one gRPC channel
each) join, receive Θ, then all push an 8M-parameter (32 MiB f32) fragment at
once; the round commits when the sixteenth push is merged and Θ is broadcast to
all sixteen. The syncer's resident memory is read from /proc/<pid>/status:
VmRSS just before the round (baseline: after Θ, momentum and one warm-up round
of q4 pushes, i.e. the state the syncer keeps between rounds), and the
kernel's peak VmHWM over the round (reset through /proc/<pid>/clear_refs just
before it; VmRSS is also sampled every millisecond as a fallback, and the sample
timeline splits the peak into "during the pushes" and "during the broadcast").

`ratio` = (peak RSS during the q4 round - baseline RSS) / one fragment's f32 size;
q4 is the islands' default wire. Goal: ratio <= 3. The merge itself needs one f32
accumulator; pushes that wait with their whole payload buffered, or per-subscriber
copies of the broadcast, make memory grow with the number of islands instead. A
round of f32 pushes (32 MiB each) is measured the same way and reported as
`f32_ratio`: there gRPC's per-stream receive windows, which grow with measured
bandwidth, hold data for every waiting stream, so it exceeds the goal.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

# _bench (scripts/) puts the repo root on sys.path before yeto/syncer are imported
from _bench import MIB, ROOT, parser, result_line

from syncer.spawn import SyncerProcess, start_syncer
from yeto import codec
from yeto.client import SyncerClient
from yeto.display import print_table
from yeto.layout import Layout


class Memory:
    """Resident memory of another process, from /proc (Linux)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def status(self) -> dict[str, int]:
        out = {}
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(rest.split()[0]) * 1024
        return out

    def reset_peak(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def start(self) -> None:
        self.samples.clear()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), self.status()["VmRSS"]))
            time.sleep(0.001)

    def peak_between(self, t0: float, t1: float) -> int:
        return max((rss for t, rss in self.samples if t0 <= t <= t1), default=0)


def start(quorum: int, workdir: Path, center_factor: float | None) -> SyncerProcess:
    centre = [] if center_factor is None else ["--center-factor", str(center_factor)]
    return start_syncer(["--quorum", str(quorum), "--grace-ms", "0", "--outer", "nesterov",
                         "--outer-lr", "0.7", "--outer-momentum", "0.9", "--log-level",
                         "WARNING", *centre],
                        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                        log=workdir / "syncer.log")


def one_round(clients, mem: Memory, payloads, encoding: str, version: int, seq: int) -> dict:
    time.sleep(0.3)  # let the syncer settle after the previous broadcast
    base = mem.status()["VmRSS"]
    hwm_ok = mem.reset_peak()
    mem.start()
    t0 = time.perf_counter()
    futs = [c.push(p, encoding=encoding, base_version=version, loss_tokens=100 + i, steps=1,
                   seq=seq) for i, (c, p) in enumerate(zip(clients, payloads))]
    for f in futs:
        if not f.result(timeout=600).accepted:
            raise RuntimeError("a push was refused")
    t_pushed = time.perf_counter()
    for c in clients:
        got = c.wait_one(timeout=600)
        if got is None or got.version != version + 1:
            raise RuntimeError(f"no broadcast of version {version + 1}")
    t_done = time.perf_counter()
    time.sleep(0.05)
    mem.stop()
    status = mem.status()
    sampled = mem.peak_between(t0, t_done + 0.05)
    peak = max(status["VmHWM"], sampled) if hwm_ok else sampled
    return {"base": base, "peak": peak, "hwm": hwm_ok,
            "push_peak": mem.peak_between(t0, t_pushed),
            "bcast_peak": mem.peak_between(t_pushed, t_done + 0.05),
            "push_s": t_pushed - t0, "round_s": t_done - t0, "after": status["VmRSS"]}


def main(argv=None) -> int:
    p = parser(__doc__.split("\n\n")[0], "\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--params", type=int, default=8 << 20,
                   help="parameters in the fragment (default 8M = 32 MiB f32; 4M with --quick)")
    p.add_argument("--islands", type=int, default=16, help="islands = quorum = pushes per round")
    p.add_argument("--center-factor", type=float, default=None,
                   help="the syncer's --center-factor (default: the syncer's; 0 = the round "
                        "without the centre bound, for its cost)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    n = (4 << 20) if args.quick and args.params == 8 << 20 else args.params
    frag = 4 * n
    layout = Layout.from_shapes({"bench.weight": (n,)})
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        syncer = start(args.islands, Path(tmp), args.center_factor)
        clients = []
        try:
            mem = Memory(syncer.pid)
            init = rng.standard_normal(n, dtype=np.float32)
            clients = [SyncerClient(syncer.address, f"island-{i:02d}", layout,
                                    backoff_s=0.05) for i in range(args.islands)]
            for c in clients:
                c.start(init)
            for c in clients:
                if c.wait_one(timeout=600) is None:
                    raise RuntimeError(f"no first broadcast: {c.fatal}")
            results = {}
            # round 1 is a warm-up (q4): the syncer reaches the state it keeps between rounds
            for r, enc in enumerate(("warm-up", "f32", "q4")):
                wire_enc = "q4" if enc == "warm-up" else enc
                payloads = [codec.encode(rng.standard_normal(n, dtype=np.float32) * 1e-3,
                                         wire_enc) for _ in clients]
                results[enc] = one_round(clients, mem, payloads, wire_enc, version=r, seq=r)
                del payloads
            del results["warm-up"]
        finally:
            for c in clients:
                c.close()
            syncer.stop(term_timeout_s=30)

    def x(v):
        return v / frag

    rows = []
    for enc, m in results.items():
        size = codec.encoded_size(enc, n)
        rows.append([f"{enc} round ({args.islands} x {size / MIB:.3g} MiB)", m["base"] / MIB,
                     m["peak"] / MIB, (m["peak"] - m["base"]) / MIB, x(m["peak"] - m["base"]),
                     x(m["push_peak"] - m["base"]), x(m["bcast_peak"] - m["base"]),
                     m["round_s"]])
    f32 = results["f32"]
    print(f"syncer memory over a round of {args.islands} pushes of {n:,} parameters "
          f"({frag / MIB:g} MiB f32); growth in MiB and in fragments; peak from "
          f"{'VmHWM' if f32['hwm'] else 'VmRSS sampled every ms'}")
    headers = ["round", "base MiB", "peak MiB", "growth MiB", "x frag", "x (pushes)",
               "x (bcast)", "round s"]
    print_table(headers, rows, right=range(1, len(headers)))
    # the ratio is for the islands' default wire (q4); f32 pushes are reported beside it
    q4 = results["q4"]
    print(result_line(x(q4["peak"] - q4["base"]), goal="<=3", wire="q4",
                      fragment_mib=frag / MIB, islands=args.islands,
                      growth_mib=(q4["peak"] - q4["base"]) / MIB,
                      push_phase_ratio=x(q4["push_peak"] - q4["base"]),
                      bcast_phase_ratio=x(q4["bcast_peak"] - q4["base"]),
                      f32_ratio=x(f32["peak"] - f32["base"]),
                      method="VmHWM" if f32["hwm"] else "VmRSS_sampled",
                      round_s=q4["round_s"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
