"""Peak memory per parameter of the syncer and of an island, full weights, q4 up.

What is measured, in one run:

  syncer   `python -m syncer` (a subprocess, through syncer.spawn) and 1, 2, 4 and 8
           synthetic islands (yeto.testing.synthetic, subprocesses: the real Island
           and gRPC client on numpy weights laid out as four full-weight tensors; one
           seeds Θ, each pushes a q4 pseudo-gradient of every parameter per round and
           waits for the f32 broadcast), quorum = islands, a state dir
           (state.safetensors after every round, final/ at the end).
           Without momentum (lr 1, μ 0: the default) and with it (lr 0.7, μ 0.9).
           Reported: the syncer's peak RSS (VmHWM of /proc/PID/status, read until it
           exits) minus its RSS once it listens (imports, gRPC server: the baseline),
           per parameter.
  island   A plain torch model (a stack of Linear layers, CPU) trained with AdamW in a
           subprocess: the bare loop, and the same loop with
           `yeto.interop.integrations.DiLoCo` around it (full weights, q4 up, a syncer
           with quorum 1). Reported: (peak RSS with DiLoCo - peak RSS of the bare loop)
           per parameter, each peak minus the subprocess's RSS after its imports.
  5e8      (--half-billion) the syncer and two synthetic islands
           (yeto.testing.synthetic, subprocesses) at 5e8 f32 parameters: the sum of
           the three processes' peak RSS and CPU seconds, seconds per round (the
           median of the rounds after the first, which touches every buffer), and the
           time raw gRPC needs to move the same bytes (measured in the same run, before
           and after the rounds: the best of each direction). Then what the island's
           training loop waits for its own push without blocking sync (one synthetic
           island, quorum 1, a push every 2 steps): staged behind the guard
           (`Island.before_update`) against staged in the loop, every other push.
           Broadcasts go over the syncer's direct port (`syncer.direct`) unless
           --syncer-args=--no-direct sends them over gRPC.
           With --shards S: the same round served by S syncer shards too (`--shard
           I/S`, one fragment each; the islands push fragment 0, wait for its round,
           then fragment 1, ...), in the same run: each shard's round time, CPU per
           round, peak RSS and syncer_over_stack (its CPU ÷ what numpy and raw gRPC
           need for its share of the bytes).

Goal: syncer <= 10 B/param without momentum, <= 14 with it, whatever the number of
islands; island overhead <= 10 B/param; the 5e8 round fits in 24 GiB and takes
<= 3x its raw gRPC time. Last line:
    RESULT syncer_bytes_per_param=X island_overhead_bytes_per_param=Y
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np

# _bench (scripts/) puts the repo root on sys.path before yeto/syncer are imported
from _bench import ROOT, parser, proc_cpu_s, proc_kib, result_line

from syncer.spawn import start_syncer
from yeto import codec, net
from yeto.codec import kernels
from yeto.display import print_table

log = logging.getLogger("bench_memory")
ISLANDS = (1, 2, 4, 8)
MOMENTUM = {"none": ["--outer", "nesterov", "--outer-lr", "1", "--outer-momentum", "0"],
            "0.9": ["--outer", "nesterov", "--outer-lr", "0.7", "--outer-momentum", "0.9"]}


class PeakWatch:
    """Polls a process's VmHWM until it exits; `peak` is the last value read.
    `cpu` holds (wall time, CPU seconds) samples of it, one per poll."""

    def __init__(self, pid: int, every_s: float = 0.01):
        self.pid, self.every_s = pid, every_s
        self.baseline = proc_kib(pid, "VmRSS") or 0
        self.peak = proc_kib(pid, "VmHWM") or 0
        self.cpu: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(self.every_s):
            self.read()

    def read(self) -> int:
        v = proc_kib(self.pid, "VmHWM")
        if v is not None:
            self.peak = max(self.peak, v)
        c = proc_cpu_s(self.pid)
        if c is not None:
            self.cpu.append((time.time(), c))
        return self.peak

    def cpu_between(self, t0: float, t1: float) -> float:
        """CPU seconds the process spent between wall times t0 and t1 (the samples
        nearest inside)."""
        inside = [c for t, c in self.cpu if t0 <= t <= t1]
        return inside[-1] - inside[0] if len(inside) > 1 else float("nan")

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.read()


# ---- payloads and islands -----------------------------------------------------------
def q4_payload(numel: int, seed: int) -> bytes:
    """A valid q4 pseudo-gradient of `numel` values, cheap to make at any size."""
    nb = -(-numel // codec.Q4_BLOCK)
    rng = np.random.default_rng(seed)
    scales = np.full(nb, 1e-4, np.float32)
    return scales.tobytes() + rng.integers(0, 256, nb * codec.Q4_BLOCK // 2, np.uint8).tobytes()


EVERY_STEP = ("--sync-every", "1", "--blocking-sync", "--stage-in-loop")  # a round per step


def synthetic_island(address: str, learner_id: str, numel: int, *flags: str) -> list[str]:
    """The command of a synthetic island (`yeto.testing.synthetic`: a real Island and
    client on numpy weights) at `numel` parameters."""
    return [sys.executable, "-m", "yeto.testing.synthetic", "--syncer", address,
            "--learner-id", learner_id, "--dim", str(numel), *flags]


def run_islands(cmds: list[list[str]], logs: list[Path], pin: bool = False) -> None:
    """Run the island commands as subprocesses (stderr to `logs`) until all exit; raise
    with the end of its log for one that failed. `pin`: island i on core i only."""
    procs = []
    for i, (cmd, log_path) in enumerate(zip(cmds, logs)):
        with open(log_path, "w") as err:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, preexec_fn=_on_core(i if pin else None),
                                          stdout=subprocess.DEVNULL, stderr=err))
    for proc, log_path in zip(procs, logs):
        if proc.wait(timeout=3600) != 0:
            raise RuntimeError(f"island {log_path.stem} failed:\n"
                               f"{log_path.read_text()[-3000:]}")


# ---- the syncer ---------------------------------------------------------------------
def measure_syncer(numel: int, islands: int, momentum: str, rounds: int,
                   extra: tuple = ()) -> dict:
    """One syncer run: `islands` synthetic islands (subprocesses) each pushing q4 of
    every parameter (every fragment) per round, for `rounds` rounds, then finishing."""
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        args = ["--quorum", str(islands), "--grace-ms", "0", "--state-dir", f"{tmp}/state",
                *MOMENTUM[momentum], *extra]
        with start_syncer(args, cwd=ROOT, log=Path(tmp) / "syncer.log") as syncer:
            watch = PeakWatch(syncer.pid)
            t0 = time.perf_counter()
            try:
                run_islands([synthetic_island(syncer.address, f"island-{i}", numel,
                                              "--layout", "full", "--steps", str(rounds),
                                              *EVERY_STEP, "--seed", str(i))
                             for i in range(islands)],
                            [Path(tmp) / f"island-{i}.log" for i in range(islands)])
            except RuntimeError as e:
                raise RuntimeError(f"syncer run failed: {e}\n{syncer.tail()}") from None
            rounds_s = time.perf_counter() - t0
            syncer.wait(timeout=120)
            peak = watch.stop()
    return dict(islands=islands, momentum=momentum, baseline_kib=watch.baseline,
                peak_kib=peak, seconds=rounds_s, bpp=(peak - watch.baseline) * 1024 / numel)


def syncer_table(rows: list[dict], numel: int) -> None:
    print(f"syncer: peak RSS (VmHWM) minus its RSS once listening, {numel:,} parameters, "
          "q4 up, f32 down, quorum = islands, state dir on")
    print_table(["islands", "momentum", "flags", "baseline MiB", "peak MiB",
                 "peak - baseline MiB", "B/param"],
                [[r["islands"], r["momentum"], r.get("extra") or "defaults",
                  r["baseline_kib"] / 1024, r["peak_kib"] / 1024,
                  (r["peak_kib"] - r["baseline_kib"]) / 1024, r["bpp"]] for r in rows],
                right=[0, 3, 4, 5, 6])


# ---- the island -----------------------------------------------------------------------
def torch_model(numel: int):
    """A plain stack of square Linear layers with about `numel` parameters."""
    import torch

    width = 4096 if numel >= 5e7 else 1024
    layers = max(1, round(numel / width / width))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                 for _ in range(layers)]), width


def island_worker(mode: str, numel: int, steps: int, sync_every: int, syncer: str) -> dict:
    """One training loop in this process: AdamW on random regression data, bare or with
    DiLoCo; returns its RSS after imports and its peak RSS (KiB)."""
    import torch

    from yeto.interop.integrations import DiLoCo

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    baseline = proc_kib(os.getpid(), "VmRSS")
    model, width = torch_model(numel)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(32, width), torch.randn(32, width)
    diloco = DiLoCo(model, syncer, learner_id="island-0", sync_every=sync_every, wire="q4",
                    tuning="full") if mode == "diloco" else None
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if diloco is not None:
            diloco.step(32 * width, loss=loss.item())
    if diloco is not None:
        diloco.finish()
    return dict(mode=mode, params=params, baseline_kib=baseline, seconds=time.perf_counter() - t0,
                peak_kib=proc_kib(os.getpid(), "VmHWM"))


def measure_island(numel: int, steps: int, sync_every: int) -> list[dict]:
    """The bare loop and the DiLoCo loop, each in its own subprocess."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        with start_syncer(["--quorum", "1", "--grace-ms", "0"], cwd=ROOT,
                          log=Path(tmp) / "syncer.log") as syncer:
            for mode in ("bare", "diloco"):
                r = subprocess.run(
                    [sys.executable, __file__, "--island-worker", mode, "--params", str(numel),
                     "--steps", str(steps), "--sync-every", str(sync_every),
                     "--syncer-address", syncer.address],
                    capture_output=True, text=True, timeout=1800)
                if r.returncode != 0:
                    raise RuntimeError(f"island worker ({mode}) failed:\n{r.stderr[-3000:]}")
                rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    return rows


def island_table(rows: list[dict]) -> float:
    bare, dl = rows
    params = bare["params"]
    per = {r["mode"]: (r["peak_kib"] - r["baseline_kib"]) * 1024 / params for r in rows}
    print(f"island: a {params:,}-parameter stack of Linear layers, AdamW, CPU, full weights, "
          "q4 up; peak RSS (VmHWM) minus the RSS after imports")
    print_table(["loop", "baseline MiB", "peak MiB", "peak - baseline MiB", "B/param", "s"],
                [[r["mode"], r["baseline_kib"] / 1024, r["peak_kib"] / 1024,
                  (r["peak_kib"] - r["baseline_kib"]) / 1024, per[r["mode"]], r["seconds"]]
                 for r in rows], right=range(1, 6))
    overhead = per["diloco"] - per["bare"]
    print(f"island overhead: {overhead:.2f} B/param (DiLoCo loop - bare loop)")
    return overhead


def main(argv=None) -> int:
    p = parser(__doc__.split("\n\n")[0], "\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--params", type=float, default=None,
                   help="parameters (default 1e8, 5e8 with --half-billion; --quick: 5e6)")
    p.add_argument("--rounds", type=int, default=2, help="rounds per syncer run")
    p.add_argument("--islands", default=",".join(map(str, ISLANDS)),
                   help="island counts for the syncer runs, comma-separated (e.g. 1,2,4)")
    p.add_argument("--momentum", default="none,0.9", help="none and/or 0.9")
    p.add_argument("--syncer-args", default="",
                   help="more syncer flags, space-separated (with --half-billion too: "
                        "--syncer-args=--no-direct measures broadcasts over gRPC)")
    p.add_argument("--skip-island", action="store_true", help="measure the syncer only")
    p.add_argument("--skip-syncer", action="store_true", help="measure the island only")
    p.add_argument("--steps", type=int, default=8, help="island training steps")
    p.add_argument("--sync-every", type=int, default=3, help="island steps per push")
    p.add_argument("--half-billion", action="store_true",
                   help="only the 5e8-parameter round: syncer + two synthetic islands")
    p.add_argument("--shards", type=int, default=1, metavar="S",
                   help="with --half-billion: also the same round served by S syncer shards "
                        "(--shard I/S, a fragment each), in the same run: round time, CPU "
                        "and syncer_over_stack per shard")
    p.add_argument("--pin-islands", action="store_true",
                   help="with --half-billion: island i runs on core i only (Linux), as if "
                        "each island had a machine of its own; each then encodes on one "
                        "thread instead of oversubscribing the shared cores")
    p.add_argument("--island-worker", choices=("bare", "diloco"), help=argparse.SUPPRESS)
    p.add_argument("--syncer-address", help=argparse.SUPPRESS)
    p.add_argument("--raw-server", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    numel = int(args.params or (5e6 if args.quick else 1e8))
    if args.raw_server:
        return raw_server_main(args.raw_server, args.port_file)
    if args.island_worker:
        print(json.dumps(island_worker(args.island_worker, numel, args.steps, args.sync_every,
                                       args.syncer_address)))
        return 0
    if args.half_billion:
        return half_billion_main(args)
    if numel < 1e8:
        print(f"NOTE: {numel:,} parameters, below the 1e8 the goal is stated at "
              f"({'--quick' if args.quick else '--params'}): fixed buffers weigh more per "
              "parameter")
    syncer_bpp = island_bpp = float("nan")
    momentum_bpp = float("nan")
    if not args.skip_syncer:
        rows = syncer_rows(numel, args)
        syncer_table(rows, numel)
        default = [r for r in rows if not r["extra"]] or rows
        syncer_bpp = max(r["bpp"] for r in default if r["momentum"] == "none")
        momentum_bpp = max((r["bpp"] for r in default if r["momentum"] != "none"),
                           default=float("nan"))
    if not args.skip_island:
        island_bpp = island_table(measure_island(numel, args.steps, args.sync_every))
    print(result_line(syncer_bytes_per_param=syncer_bpp, island_overhead_bytes_per_param=island_bpp,
                      syncer_momentum_bytes_per_param=momentum_bpp, params=numel))
    return 0


def syncer_rows(numel: int, args) -> list[dict]:
    """Every island count with the default flags, and the most islands with
    --max-inflight-pushes 2 and with pushes held in memory (--spill-min-mib 1e9, the
    behaviour before spilling), for each momentum setting; 2 islands with --fragments 4."""
    counts = [int(k) for k in args.islands.split(",")]
    extra = tuple(args.syncer_args.split())
    rows = []
    for m in args.momentum.split(","):
        runs = [(k, extra) for k in counts]
        if max(counts) > 2 and not extra:
            runs.append((max(counts), ("--max-inflight-pushes", "2")))
            runs.append((max(counts), ("--spill-min-mib", "1e9")))
        if 2 in counts and not extra and m == "none":
            runs.append((2, ("--fragments", "4")))
        for k, ex in runs:
            r = measure_syncer(numel, k, m, args.rounds, ex)
            r["extra"] = " ".join(ex)
            rows.append(r)
    return rows


# ---- the half-billion round ----------------------------------------------------------
def raw_server_main(total: int, port_file: Path) -> int:
    """A raw gRPC server (bench_transfer's) in its own process, as the syncer is."""
    from bench_transfer import raw_server

    from yeto.io import atomic_write

    server, port = raw_server(total)
    atomic_write(port_file, str(port))
    server.wait_for_termination()
    return 0


def _together(fns) -> float:
    """Run the callables in threads at once; seconds until all are done."""
    threads = [threading.Thread(target=fn) for fn in fns]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def raw_grpc(up_bytes: int, down_bytes: int, streams: int, repeat: int = 2,
             cpu: dict | None = None) -> tuple[float, float]:
    """Best seconds for `streams` concurrent raw uploads of `up_bytes` each, then as many
    concurrent raw downloads of `down_bytes` each (another process), at each of
    bench_transfer's raw message sizes: the fastest of each direction. `cpu`: gets the
    server process's fewest CPU seconds for each direction ("up", "down"), kept if less
    than what it holds."""
    from bench_transfer import raw_down, raw_messages, raw_up

    with tempfile.TemporaryDirectory(prefix="bench-raw-") as tmp:
        port_file = Path(tmp) / "port"
        proc = subprocess.Popen([sys.executable, __file__, "--raw-server", str(down_bytes),
                                 "--port-file", str(port_file)])
        try:
            while not port_file.exists():
                if proc.poll() is not None:
                    raise RuntimeError("the raw gRPC server did not start")
                time.sleep(0.05)
            addr = f"127.0.0.1:{port_file.read_text()}"
            opts = net.GRPC_OPTIONS + [("grpc.use_local_subchannel_pool", 1)]
            chans = [grpc.insecure_channel(addr, options=opts) for _ in range(streams)]
            best_up = best_down = float("inf")
            cpu = {} if cpu is None else cpu

            def timed(way: str, fns) -> float:
                c0 = proc_cpu_s(proc.pid)
                seconds = _together(fns)
                cpu[way] = min(cpu.get(way, float("inf")), proc_cpu_s(proc.pid) - c0)
                return seconds

            for size, pieces in raw_messages(up_bytes).items():
                for _ in range(repeat):
                    best_up = min(best_up, timed("up", [lambda c=c, p=pieces: raw_up(c, p)
                                                        for c in chans]))
                for _ in range(repeat):
                    best_down = min(best_down, timed("down", [
                        lambda c=c, s=size: raw_down(c, s) for c in chans]))
            for ch in chans:
                ch.close()
        finally:
            proc.terminate()
            proc.wait()
    return best_up, best_down


def mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / (1 << 20)
    return float("nan")


def _on_core(i: int | None):
    """A subprocess's preexec_fn that keeps it on core i (None: anywhere)."""
    if i is None:
        return None
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("--pin-islands needs Linux and at least 2 cores")
    core = sorted(os.sched_getaffinity(0))[i]
    return lambda: os.sched_setaffinity(0, {core})


def half_billion_run(numel: int, rounds: int, tmp: Path, pin: bool = False,
                     shards: int = 1, extra: tuple[str, ...] = ()) -> dict:
    """The syncer (or `shards` shards, each owning one of as many fragments) and two
    synthetic islands (subprocesses), blocking sync every step, each push staged in the
    training loop (with blocking sync the loop waits for the round anyway:
    `island_overlap_run` measures the guard); `pin`: each island on a core of its own
    (the syncers anywhere). With shards an island pushes fragment 0, waits for its round,
    then fragment 1, ...: each shard's round is timed and its CPU read on its own."""
    tmp = tmp / f"s{shards}"
    tmp.mkdir(parents=True, exist_ok=True)
    records = [tmp / f"half-{i}.jsonl" for i in range(2)]
    children_cpu, t0 = _children_cpu_s(), time.perf_counter()
    flags = [["--quorum", "2", "--grace-ms", "0"] + (
        ["--shard", f"{s}/{shards}", "--fragments", str(shards), "--seed-from", "half-0"]
        if shards > 1 else []) + list(extra) for s in range(shards)]
    with contextlib.ExitStack() as stack:
        syncers = [stack.enter_context(start_syncer(f, cwd=ROOT, log=tmp / f"syncer-{s}.log"))
                   for s, f in enumerate(flags)]
        watches = [PeakWatch(s.pid) for s in syncers]
        address = ";".join(s.address for s in syncers)
        run_islands([synthetic_island(address, f"half-{i}", numel, "--steps", str(rounds),
                                      *EVERY_STEP, "--seed", str(i), "--record", str(rec))
                     for i, rec in enumerate(records)],
                    [tmp / f"half-{i}.log" for i in range(2)], pin=pin)
        for s in syncers:
            s.wait(timeout=300)
        peaks = [w.stop() for w in watches]
    children_cpu = _children_cpu_s() - children_cpu  # the syncers and both islands
    wall = time.perf_counter() - t0
    recs = [[json.loads(line) for line in r.read_text().splitlines()] for r in records]
    done = [[e for e in r if e["event"] == "done"][-1] for r in recs]
    if not all(d["final"] for d in done) or done[0]["weights_sha256"] != done[1]["weights_sha256"]:
        raise RuntimeError("the islands did not end with the same final weights")
    islands_cpu = [d["cpu_s"] for d in done]
    per_round = _round_seconds(recs, rounds, shards)
    for r in per_round:
        parts = r.pop("parts")  # shard s's round: its fragment's push to both applied
        r["syncer_cpu"] = [w.cpu_between(p["start"], p["end"]) for w, p in zip(watches, parts)]
        r["shard_s"] = [p["end"] - p["start"] for p in parts]
    return dict(syncer_peak_kib=max(peaks), shard_peak_kib=peaks,
                island_peak_kib=[d["peak_rss_kib"] for d in done],
                round_s=per_round, cpu_s=[children_cpu - sum(islands_cpu), *islands_cpu],
                wall_s=wall,  # the pushes after each island's first (which touches every page)
                blocked_s=[b for d in done for b in d["blocked_s"][1:]],
                encode_s=[e for d in done for e in d["encode_s"][1:]], shards=shards,
                share=[1.0 / shards] * shards)


OVERLAP_PUSHES = 9  # pushes of island_overlap_run's training steps: the first aside, 4 + 4


def island_overlap_run(numel: int, tmp: Path) -> tuple[dict, dict]:
    """What the training loop waits for its own push, where that is all it waits
    for: one synthetic island (a subprocess) and a syncer with quorum 1, no blocking
    sync, a push every 2 steps (each step a read-only gradient pass, the guard, the
    update), one step more after the last (finish pushes it: not counted). Every
    other push is staged behind the guard, the others in the training loop (the
    baseline), so both meet the same load. Returns (behind the guard, in the loop),
    each per push after the first: `blocked_s` (the push call plus the guard's wait),
    `encode_s` (the encode proper, on the background thread: less the staging there),
    `stage_s` (that staging); and `bpp`, the island's peak RSS per parameter (its
    weights included)."""
    rec = tmp / "overlap.jsonl"
    with start_syncer(["--quorum", "1", "--grace-ms", "0"], cwd=ROOT,
                      log=tmp / "overlap-syncer.log") as syncer:
        run_islands([synthetic_island(syncer.address, "overlap", numel,
                                      "--steps", str(2 * OVERLAP_PUSHES + 1), "--sync-every", "2",
                                      "--alternate-guard", "--record", str(rec))],
                    [tmp / "overlap-island.log"])
        syncer.wait(timeout=300)
    done = [json.loads(line) for line in rec.read_text().splitlines()][-1]
    if len(done["guarded"]) != OVERLAP_PUSHES or len(done["encode_s"]) < OVERLAP_PUSHES:
        raise RuntimeError(f"overlap island pushed {len(done['guarded'])} times in its "
                           f"steps, not {OVERLAP_PUSHES}")
    stages = iter(done["stage_s"])
    out = ({}, {})
    for i, guarded in enumerate(done["guarded"]):
        stage = next(stages) if guarded else 0.0
        if i == 0:
            continue  # it touches every page
        row = out[0 if guarded else 1]
        for key, value in (("blocked_s", done["blocked_s"][i]), ("stage_s", stage),
                           ("encode_s", done["encode_s"][i] - stage)):
            row.setdefault(key, []).append(value)
    for row in out:
        row["bpp"] = done["peak_rss_kib"] * 1024 / numel
    return out


def overlap_table(guard: dict, loop: dict) -> tuple[float, float]:
    """The island's push with the guard against staging in the loop (both measured
    in this run); returns (blocked, encode) of the guard run: medians."""
    med = statistics.median
    print_table(["island, no blocking sync (median per push)", "loop waits s", "encode s",
                 "staging in the background s"],
                [["push staged in the training loop (no guard)", med(loop["blocked_s"]),
                  med(loop["encode_s"]), ""],
                 ["push staged behind the guard (Island.before_update)",
                  med(guard["blocked_s"]), med(guard["encode_s"]), med(guard["stage_s"])]],
                right=[1, 2, 3])
    print(f"the island's peak RSS: {guard['bpp']:.2f} B/param (its weights included)")
    return med(guard["blocked_s"]), med(guard["encode_s"])


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's children that have been waited for."""
    t = os.times()
    return t.children_user + t.children_system


def _round_seconds(recs: list[list[dict]], rounds: int, fragments: int = 1) -> list[dict]:
    """Per round, from the islands' records: `total` from the first island starting to
    encode its push to both having applied the merged weights; `encode` until the
    last push is handed to its client; `merge` until the last reply (the last push
    of a round is answered after the commit: transfer, merge, outer step); `bcast`
    until both applied the broadcast. With `fragments` (blocking, one after another in
    a step): the round spans them all, and `parts` holds each fragment's (start, end)."""
    def times(event: str, k: int, f: int) -> list[float]:
        """Each island's time of the k-th `event` of fragment f (for "applied": of
        version k + 1; "push" events carry no fragment: they alternate)."""
        if event == "applied":
            return [next(e["time"] for e in rec if e["event"] == event and
                         e["version"] == k + 1 and e.get("fragment", 0) == f) for rec in recs]
        if event == "push":
            return [[e["time"] for e in rec if e["event"] == event][k * fragments + f]
                    for rec in recs]
        return [[e["time"] for e in rec if e["event"] == event and
                 e.get("fragment", 0) == f][k] for rec in recs]

    out = []
    for r in range(rounds):
        parts = []
        for f in range(fragments):
            start, sent = min(times("push", r, f)), max(times("sent", r, f))
            replied, applied = max(times("replied", r, f)), max(times("applied", r, f))
            parts.append(dict(start=start, sent=sent, replied=replied, end=applied))
        start, end = parts[0]["start"], parts[-1]["end"]
        out.append(dict(total=end - start, encode=sum(p["sent"] - p["start"] for p in parts),
                        merge=sum(p["replied"] - p["sent"] for p in parts),
                        bcast=sum(p["end"] - p["replied"] for p in parts), start=start,
                        end=end, parts=parts))
    return out


def memcpy_rate(nbytes: int = 256 << 20, repeat: int = 10) -> float:
    """Bytes moved (read + written) per CPU second by a one-thread copy of `nbytes`
    between two buffers already in memory: the best of `repeat`. CPU seconds of the
    copying thread, as the syncer's are counted, so other jobs on the cores do not
    stretch it (they still share the memory bus)."""
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)  # its pages, faulted in once
    best = float("inf")
    for _ in range(repeat):
        t0 = time.thread_time()
        np.copyto(dst, src)
        best = min(best, time.thread_time() - t0)
    return 2 * nbytes / best


def arithmetic_cpu_s(numel: int, islands: int = 2, repeat: int = 3) -> float:
    """CPU seconds (this process, all its threads) of a round's arithmetic alone, done
    as the syncer does it (`syncer.merge.MergeAccumulator`): `islands` q4 pushes held in
    memory decoded into the sum with their norms (the first assigns it), then the outer
    step (lr 1, μ 0); the fewest of `repeat` rounds on the same buffers."""
    from syncer.merge import MergeAccumulator
    from syncer.strategy import Nesterov

    payload, theta = q4_payload(numel, seed=0), np.zeros(numel, np.float32)
    scratch, best = None, float("inf")
    for _ in range(repeat):
        acc = MergeAccumulator(numel)
        if scratch is not None:
            acc.reuse(scratch)
        t0 = time.process_time()
        for i in range(islands):
            acc.add(payload, "q4", 100 + i)
        scratch = acc.step_outer(Nesterov(), theta, None)
        best = min(best, time.process_time() - t0)
    return best


def round_floor_bytes(numel: int, islands: int, momentum: bool = False) -> int:
    """The bytes one round makes the syncer read and write, at the least: each q4 push
    read from its socket into memory (read + write), decoded and summed (the first
    push writes the sum, the others read and write it), the outer step (the sum and
    Θ read, Θ written; m read and written with momentum), and the f32 broadcast read
    from Θ into each island's socket (read + write)."""
    push, vec = codec.encoded_size("q4", numel), 4 * numel
    receive = islands * 2 * push
    merge = islands * push + vec + (islands - 1) * 2 * vec
    step = 3 * vec + (2 * vec if momentum else 0)
    broadcast = islands * 2 * vec
    return receive + merge + step + broadcast


def half_billion_main(args) -> int:
    numel = int(args.params or (5e7 if args.quick else 5e8))
    rounds = max(3, args.rounds)  # the first touches every buffer: the median is of the rest
    avail = mem_available_gib()
    print(f"{numel:,} f32 parameters, 2 synthetic islands"
          f"{' (each on a core of its own)' if args.pin_islands else ''}, q4 up, f32 down, "
          f"quorum 2, no state dir, blocking sync every step; {avail:.1f} GiB available "
          "before the run")
    up = codec.encoded_size("q4", numel)
    copy_rate = memcpy_rate()
    raw_cpu: dict = {}  # the raw server's CPU seconds for each direction, best
    before = raw_grpc(up, 4 * numel, streams=2, cpu=raw_cpu)
    with tempfile.TemporaryDirectory(prefix="bench-half-") as tmp:
        extra = tuple(args.syncer_args.split())
        run = half_billion_run(numel, rounds, Path(tmp), pin=args.pin_islands, extra=extra)
        sharded = half_billion_run(numel, rounds, Path(tmp), pin=args.pin_islands,
                                   shards=args.shards, extra=extra) if args.shards > 1 else None
        guard, loop = island_overlap_run(numel, Path(tmp))
    after = raw_grpc(up, 4 * numel, streams=2, cpu=raw_cpu)  # the speed drifts: best of both
    raw_up, raw_down = min(before[0], after[0]), min(before[1], after[1])
    peaks = [run["syncer_peak_kib"], *run["island_peak_kib"]]
    total_gib = sum(peaks) / (1 << 20)
    raw = raw_up + raw_down
    round_s = statistics.median(r["total"] for r in run["round_s"][1:])
    print_table(["process", "peak RSS GiB", "B/param", "CPU s (whole run)"],
                [[name, k / (1 << 20), k * 1024 / numel, cpu] for name, k, cpu in
                 zip(["syncer", "island 0", "island 1"], peaks, run["cpu_s"])] +
                [["sum", total_gib, sum(peaks) * 1024 / numel, sum(run["cpu_s"])]],
                right=[1, 2, 3])
    print(f"CPU seconds of the three ÷ the run's {run['wall_s']:.1f} wall seconds: "
          f"{sum(run['cpu_s']) / run['wall_s']:.2f} of the machine's {os.cpu_count()} cores busy")
    print_table(["path", "seconds", "GiB moved"],
                [["raw gRPC: 2 q4 pushes at once", raw_up, 2 * up / (1 << 30)],
                 ["raw gRPC: 2 f32 broadcasts at once", raw_down, 8 * numel / (1 << 30)],
                 ["raw gRPC: the round's bytes", raw, (2 * up + 8 * numel) / (1 << 30)],
                 ["round (median after the first): first push encode to both applied",
                  round_s, ""]],
                right=[1, 2])
    print_table(["round", "total s", "islands encode", "push + merge + step", "broadcast + apply",
                 "syncer CPU s"],
                [[i + 1, r["total"], r["encode"], r["merge"], r["bcast"], r["syncer_cpu"][0]]
                 for i, r in enumerate(run["round_s"])], right=range(6))
    copy_rate = max(copy_rate, memcpy_rate())  # the best of before and after the rounds
    cpu, _, _ = _floor_table(run, numel, copy_rate)
    arith, transport = _stack_table(numel, copy_rate, arithmetic_cpu_s(numel), raw_cpu)
    blocked, encode = overlap_table(guard, loop)
    shard_kv = _shard_table(run, sharded, numel, copy_rate, arith + transport) if sharded else {}
    print(result_line(cpu_over_floor=cpu, arith_over_floor=arith,
                      syncer_over_stack=cpu / (arith + transport), raw_cpu_over_floor=transport,
                      island_blocked_s=blocked, encode_s=encode,
                      island_blocked_in_loop_s=statistics.median(loop["blocked_s"]),
                      half_billion_peak_gib=total_gib, round_s=round_s, raw_s=raw,
                      round_over_raw=round_s / raw, params=numel, **shard_kv))
    return 0


def _shard_table(one: dict, sharded: dict, numel: int, copy_rate: float,
                 stack: float) -> dict:
    """S = 1 against S shards, from the same invocation: the round time, and per shard
    its round (its fragment pushed to both islands applied), its CPU per round and that
    CPU against what numpy and raw gRPC need for its share of the bytes (the stack's
    figure × its share). Medians over the rounds after the first. Returns RESULT keys."""
    floor_s = round_floor_bytes(numel, 2) / copy_rate
    later = sharded["round_s"][1:]
    rows = [["S = 1", "syncer", statistics.median(r["total"] for r in one["round_s"][1:]),
             statistics.median(r["syncer_cpu"][0] for r in one["round_s"][1:]),
             one["syncer_peak_kib"] / (1 << 20),
             statistics.median(r["syncer_cpu"][0] for r in one["round_s"][1:])
             / floor_s / stack]]
    over = []
    for s in range(sharded["shards"]):
        cpu = statistics.median(r["syncer_cpu"][s] for r in later)
        over.append(cpu / floor_s / (stack * sharded["share"][s]))
        rows.append([f"S = {sharded['shards']}", f"shard {s}",
                     statistics.median(r["shard_s"][s] for r in later), cpu,
                     sharded["shard_peak_kib"][s] / (1 << 20), over[-1]])
    print_table(["run", "syncer", "round s (median)", "CPU s per round", "peak RSS GiB",
                 "÷ stack (its share)"], rows, right=[2, 3, 4, 5])
    round_sharded = statistics.median(r["total"] for r in later)
    print(f"S = {sharded['shards']}: a step's rounds, one shard after the other (blocking "
          f"sync): {round_sharded:.2f} s")
    return dict(shards=sharded["shards"], shard_round_s=round_sharded,
                shard_syncer_over_stack=",".join(f"{x:.3f}" for x in over),
                shard_syncer_over_stack_max=max(over))


def _floor_table(run: dict, numel: int, copy_rate: float) -> tuple[float, float, float]:
    """The syncer's CPU seconds per round against the floor (`round_floor_bytes` at
    `copy_rate`), and the islands' push: seconds the training loop waited for it
    (`Island.blocked_s`) and seconds its encode took on the background thread. Returns
    (CPU ÷ floor, blocked, encode): medians over the rounds after the first."""
    floor_s = round_floor_bytes(numel, 2) / copy_rate
    cpu = statistics.median(r["syncer_cpu"][0] for r in run["round_s"][1:])
    blocked, encode = statistics.median(run["blocked_s"]), statistics.median(run["encode_s"])
    print_table(["what", "seconds"],
                [[f"memcpy: {copy_rate / 1e9:.1f} GB moved (read + written) per CPU second, "
                  "one thread, best before and after the rounds", ""],
                 [f"floor: {round_floor_bytes(numel, 2) / 1e9:.2f} GB a round at that rate",
                  floor_s],
                 ["syncer CPU per round (median after the first)", cpu],
                 ["islands, blocking run: loop waiting for its push, staged in the loop "
                  "(median)", blocked],
                 ["islands, blocking run: the push's encode, background (median)", encode]],
                right=[1])
    return cpu / floor_s, blocked, encode


def _stack_table(numel: int, copy_rate: float, arith_s: float,
                 raw_cpu: dict) -> tuple[float, float]:
    """What numpy and gRPC alone need of a round, against the floor: the round's
    arithmetic (`arithmetic_cpu_s`) and the raw gRPC server's CPU for the round's bytes
    (two q4 pushes in, two f32 broadcasts out, each the best seen). Returns both ÷ floor."""
    floor_s = round_floor_bytes(numel, 2) / copy_rate
    transport = raw_cpu["up"] + raw_cpu["down"]
    print_table(["the round's parts alone, CPU seconds (measured in this run)", "seconds",
                 "÷ floor"],
                [["arithmetic: 2 q4 pushes decoded and summed, the outer step "
                  f"({kernels.backend()}, as the syncer does it, best of 3)", arith_s,
                  arith_s / floor_s],
                 ["raw gRPC server: 2 q4 pushes in (best)", raw_cpu["up"],
                  raw_cpu["up"] / floor_s],
                 ["raw gRPC server: 2 f32 broadcasts out (best)", raw_cpu["down"],
                  raw_cpu["down"] / floor_s],
                 ["together: the least this stack spends on a round", arith_s + transport,
                  (arith_s + transport) / floor_s]], right=[1, 2])
    return arith_s / floor_s, transport / floor_s


if __name__ == "__main__":
    raise SystemExit(main())
