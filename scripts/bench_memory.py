"""Peak memory per parameter of the syncer and of an island, full weights, q4 up.

What is measured, in one run:

  syncer   `python -m syncer` (a subprocess, through syncer.spawn) and 1, 2 and 4
           lean in-process islands over gRPC (threads, raw stubs: they join, one
           seeds Θ, each pushes a q4 pseudo-gradient of every parameter per round
           and drains the f32 broadcast without keeping it), quorum = islands, a
           state dir (state.safetensors after every round, final/ at the end).
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
           (scripts/synthetic_island.py, subprocesses) at 5e8 f32 parameters: the sum of
           the three processes' peak RSS, seconds per round, and the time raw gRPC needs
           to move the same bytes (measured in the same run, as bench_transfer does).

Goal: syncer <= 10 B/param without momentum, <= 14 with it, whatever the number of
islands; island overhead <= 10 B/param; the 5e8 round fits in 24 GiB and takes
<= 3x its raw gRPC time. Last line:
    RESULT syncer_bytes_per_param=X island_overhead_bytes_per_param=Y
"""

from __future__ import annotations

import logging
import os
import queue
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np

# _bench (scripts/) puts the repo root on sys.path before yeto/syncer are imported
from _bench import MIB, ROOT, parser

from syncer.spawn import start_syncer
from yeto import codec, net
from yeto.cli.display import print_table
from yeto.layout import Layout
from yeto.proto import yeto_pb2 as pb
from yeto.proto import yeto_pb2_grpc as pb_grpc

log = logging.getLogger("bench_memory")
ISLANDS = (1, 2, 4)
MOMENTUM = {"none": ["--outer-lr", "1", "--outer-momentum", "0"],
            "0.9": ["--outer-lr", "0.7", "--outer-momentum", "0.9"]}


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


class PeakWatch:
    """Polls a process's VmHWM until it exits; `peak` is the last value read."""

    def __init__(self, pid: int, every_s: float = 0.01):
        self.pid, self.every_s = pid, every_s
        self.baseline = proc_kib(pid, "VmRSS") or 0
        self.peak = proc_kib(pid, "VmHWM") or 0
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
        return self.peak

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.read()


# ---- lean islands -----------------------------------------------------------------
def q4_payload(numel: int, seed: int) -> bytes:
    """A valid q4 pseudo-gradient of `numel` values, cheap to make at any size."""
    nb = -(-numel // codec.Q4_BLOCK)
    rng = np.random.default_rng(seed)
    scales = np.full(nb, 1e-4, np.float32)
    return scales.tobytes() + rng.integers(0, 256, nb * codec.Q4_BLOCK // 2, np.uint8).tobytes()


def seed_chunks(numel: int):
    """f32 initial weights, generated chunk by chunk (never whole in this process)."""
    step = net.CHUNK_BYTES // 4
    rng = np.random.default_rng(0)
    for lo in range(0, numel, step):
        yield rng.standard_normal(min(step, numel - lo), dtype=np.float32).tobytes()


class LeanIsland:
    """Joins, seeds, pushes prepared payloads, counts broadcast bytes: a syncer load
    that keeps nothing per parameter but the payload it is given."""

    def __init__(self, address: str, learner_id: str, layout: Layout):
        opts = net.GRPC_OPTIONS + [("grpc.use_local_subchannel_pool", 1)]
        self.channel = grpc.insecure_channel(address, options=opts)
        self.stub = pb_grpc.SyncerStub(self.channel)
        self.learner_id, self.layout = learner_id, layout
        self.got: queue.Queue = queue.Queue()  # (version, final) per complete broadcast
        self.bytes_down = 0
        self.generation = 0

    def join(self) -> None:
        req = pb.JoinRequest(learner_id=self.learner_id, fingerprint=self.layout.fingerprint,
                             backend="numpy", layout=[
                                 pb.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype)
                                 for s in self.layout.specs])
        reply = self.stub.Join(req, timeout=60)
        self.generation = reply.generation
        if reply.send_seed:
            h = pb.PushHeader(learner_id=self.learner_id, generation=self.generation,
                              kind=pb.SEED, encoding="f32", numel=self.layout.numel,
                              payload_bytes=4 * self.layout.numel)
            self._push(h, seed_chunks(self.layout.numel))
        threading.Thread(target=self._listen, daemon=True).start()

    def _listen(self) -> None:
        stream = self.stub.Subscribe(pb.SubscribeRequest(learner_id=self.learner_id,
                                                         generation=self.generation))
        header, n = None, 0
        try:
            for chunk in stream:
                if chunk.HasField("header"):
                    header, n = chunk.header, 0
                n += len(chunk.data)
                self.bytes_down += len(chunk.data)
                if header is not None and n == header.payload_bytes:
                    self.got.put((header.version, header.final))
        except grpc.RpcError:
            pass
        self.got.put((-1, True))

    def _push(self, header, pieces) -> pb.PushReply:
        def chunks():
            for i, piece in enumerate(pieces):
                yield pb.PushChunk(header=header if i == 0 else None, data=piece)
        return self.stub.Push(chunks(), timeout=600)

    def push(self, payload: bytes, version: int, seq: int) -> pb.PushReply:
        h = pb.PushHeader(learner_id=self.learner_id, generation=self.generation,
                          round=version + 1, base_version=version, loss_tokens=100 + seq,
                          steps=1, encoding="q4", numel=self.layout.numel,
                          payload_bytes=len(payload), kind=pb.DELTA, seq=seq)
        return self._push(h, (bytes(p) for p in net.chunks(payload)))

    def wait_version(self, version: int, timeout: float = 600) -> bool:
        """Wait for broadcast `version` (True), or the final one (False)."""
        while True:
            v, final = self.got.get(timeout=timeout)
            if final or v >= version:
                return not final

    def finish(self) -> None:
        self.stub.Finish(pb.FinishRequest(learner_id=self.learner_id,
                                          generation=self.generation), timeout=60)

    def close(self) -> None:
        self.channel.close()


# ---- the syncer ---------------------------------------------------------------------
def flat_layout(numel: int) -> Layout:
    """Full-weight-like: a few big tensors, as a model's state dict has."""
    parts = 4
    sizes = [numel // parts] * (parts - 1) + [numel - (parts - 1) * (numel // parts)]
    return Layout.from_shapes({f"model.layers.{i}.mlp.weight": (n,) for i, n in enumerate(sizes)})


def _island_rounds(isl: LeanIsland, payload: bytes, rounds: int, errors: list) -> None:
    try:
        for r in range(rounds):
            if not isl.wait_version(r):
                raise RuntimeError(f"{isl.learner_id}: run ended before round {r + 1}")
            if not isl.push(payload, r, seq=r).accepted:
                raise RuntimeError(f"{isl.learner_id}: push {r} not accepted")
        isl.wait_version(rounds)
    except Exception as e:  # reported by the caller
        errors.append(e)


def measure_syncer(numel: int, islands: int, momentum: str, rounds: int,
                   extra: tuple = ()) -> dict:
    """One syncer run: `islands` lean islands, `rounds` rounds, then finish."""
    layout = flat_layout(numel)
    payload = q4_payload(numel, seed=islands)
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        args = ["--quorum", str(islands), "--rounds", "0", "--grace-ms", "0",
                "--state-dir", f"{tmp}/state", *MOMENTUM[momentum], *extra]
        with start_syncer(args, cwd=ROOT, log=Path(tmp) / "syncer.log") as syncer:
            watch = PeakWatch(syncer.pid)
            fleet = [LeanIsland(syncer.address, f"island-{i}", layout) for i in range(islands)]
            t0 = time.perf_counter()
            for isl in fleet:
                isl.join()
            errors: list = []
            threads = [threading.Thread(target=_island_rounds, args=(isl, payload, rounds, errors))
                       for isl in fleet]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise RuntimeError(f"syncer run failed: {errors[0]}\n{syncer.tail()}")
            rounds_s = time.perf_counter() - t0
            in_rounds = watch.read()
            for isl in fleet:
                isl.finish()
            for isl in fleet:
                isl.wait_version(1 << 62)
                isl.close()
            syncer.wait(timeout=120)
            peak = watch.stop()
    return dict(islands=islands, momentum=momentum, baseline_kib=watch.baseline,
                peak_kib=peak, rounds_peak_kib=in_rounds, seconds=rounds_s,
                bpp=(peak - watch.baseline) * 1024 / numel)


def syncer_table(rows: list[dict], numel: int) -> None:
    print(f"syncer: peak RSS (VmHWM) minus its RSS once listening, {numel:,} parameters, "
          "q4 up, f32 down, quorum = islands, state dir on")
    print_table(["islands", "momentum", "baseline MiB", "peak MiB", "peak - baseline MiB",
                 "B/param", "rounds peak B/param"],
                [[r["islands"], r["momentum"], r["baseline_kib"] / 1024, r["peak_kib"] / 1024,
                  (r["peak_kib"] - r["baseline_kib"]) / 1024, r["bpp"],
                  (r["rounds_peak_kib"] - r["baseline_kib"]) * 1024 / numel] for r in rows],
                right=range(7))


def main(argv=None) -> int:
    p = parser(__doc__.split("\n\n")[0], "\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--params", type=float, default=1e8,
                   help="parameters (default 1e8; --quick uses 5e6 unless given)")
    p.add_argument("--rounds", type=int, default=2, help="rounds per syncer run")
    p.add_argument("--islands", default=",".join(map(str, ISLANDS)),
                   help="island counts for the syncer runs")
    p.add_argument("--momentum", default="none,0.9", help="none and/or 0.9")
    p.add_argument("--syncer-args", default="", help="more syncer flags, space-separated")
    p.add_argument("--skip-island", action="store_true", help="measure the syncer only")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    numel = int(5e6 if args.quick and args.params == 1e8 else args.params)
    if numel < 1e8:
        print(f"NOTE: {numel:,} parameters, below the 1e8 the goal is stated at "
              f"({'--quick' if args.quick else '--params'}): fixed buffers weigh more per "
              "parameter")
    rows = [measure_syncer(numel, k, m, args.rounds, tuple(args.syncer_args.split()))
            for m in args.momentum.split(",") for k in map(int, args.islands.split(","))]
    syncer_table(rows, numel)
    worst = max(r["bpp"] for r in rows)
    print(f"RESULT syncer_bytes_per_param={worst:.2f} island_overhead_bytes_per_param=nan")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
