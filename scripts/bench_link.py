"""Network wait of an island behind a slow link: a home uplink of 20 Mbit/s.

In the network lab (yeto.testing.netlab; needs root) the syncer runs on host a and one
torch island (`python -m yeto.learner`, quorum 1) on host b, whose cable is limited
to --rate-mbit each way (tbf), with --delay-ms of one-way latency added by a relay
on b. Four arms: LoRA and full weights of the bench model (the tiny llama by
default, or --model), each with plain rounds (--fragments 1) and streaming
fragments (--fragments 4); the island's own defaults otherwise (H = --sync-every
50, q4 pushes, f32 broadcasts, one push in flight).

Measured per arm, inside the island (its `SyncerClient.wait` calls and its waits for
push replies, `PushLedger.settle(wait=True)`, timed): the time it is blocked on the
network, as a share of its training time (from the moment it
holds the run's weights to the start of its last push: the steady state), and as
a share of the whole run from joining to the end (joining, seeding Θ, the last
push and the final weights included). Also: bytes up and down, the time the link
needs for them, the time pushes were in flight during training (from the push to
the syncer's reply) and the share of it the island trained through rather than
waited (it keeps training while a transfer is in flight: a push goes out on a
sender thread, the broadcast comes back on the connection thread).

Goal: network wait <= 1 % of island time for LoRA at the default H; with full
weights, streaming fragments (P = 4) keep it below 5 % where plain rounds do not.

Last line: RESULT wait_share=<LoRA, P=1> wait_share_P4=<full weights, P=4> ...
(steady-state shares; the whole-run shares follow as *_run keys).

    sudo python scripts/bench_link.py                 # ~2-4 minutes
    sudo python scripts/bench_link.py --quick         # smaller, for smoke tests
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# _bench (scripts/) puts the repo root on sys.path before yeto/syncer are imported
from _bench import parser, result_line

from yeto.display import print_table
from yeto.testing import netlab

TOKEN = "bench-link-token"
PORT = 29400
ARMS = [("lora", 1), ("lora", 4), ("full", 1), ("full", 4)]


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__, quick="fewer, shorter steps (seq 64, batch 4, H 25, 100 steps)")
    p.add_argument("--rate-mbit", type=float, default=20.0, help="link rate each way")
    p.add_argument("--delay-ms", type=float, default=20.0,
                   help="one-way latency added by a relay on the island's host (0: none)")
    p.add_argument("--model", type=Path, default=None,
                   help="a local Hugging Face model dir (default: the tiny llama fixture)")
    p.add_argument("--max-steps", type=int, default=None, help="island steps (default 200)")
    p.add_argument("--sync-every", type=int, default=None, help="H (default: the island's 50)")
    p.add_argument("--threads", type=int, default=1, help="the island's torch threads")
    p.add_argument("--pipeline", type=int, default=1,
                   help="fragments in flight at once in the P=4 arms (the island's default 1)")
    p.add_argument("--downlink", choices=("f32", "bf16", "q4"), default=None,
                   help="the syncer's broadcast encoding (default: the syncer's, f32)")
    p.add_argument("--out", type=Path, default=None, help="keep the arms' outputs here")
    return p.parse_args(argv)


def island_flags(args) -> list[str]:
    """The island's flags beyond model, data and syncer (its defaults where not given)."""
    flags = ["--threads", str(args.threads), "--no-progress", "--max-steps",
             str(args.max_steps or (100 if args.quick else 200))]
    if args.quick:
        flags += ["--seq-len", "64", "--batch-size", "4"]
    if args.sync_every or args.quick:
        flags += ["--sync-every", str(args.sync_every or 25)]
    return flags


# ---- one arm ---------------------------------------------------------------------------
def run_arm(args, model: Path, data: Path, tuning: str, fragments: int, work: Path) -> dict:
    """Syncer on a, the island on b behind the limited link; returns its measurements."""
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, YETO_TOKEN=TOKEN, PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false")
    with netlab.Lab() as lab:
        a, b = lab.host("a"), lab.host("b", rate_mbit=args.rate_mbit)
        target = f"{a.addr}:{PORT}"
        if args.delay_ms > 0:
            _, target = lab.relay(b, target, args.delay_ms)
        port_file = work / "port"
        with open(work / "syncer.log", "w") as log:
            syncer = lab.popen(a, [sys.executable, "-m", "syncer", "--host", a.addr, "--port",
                                   str(PORT), "--port-file", port_file, "--quorum", "1",
                                   "--fragments", str(fragments), "--state-dir", work / "syncer",
                                   *(["--downlink", args.downlink] if args.downlink else [])],
                               stdout=log, stderr=subprocess.STDOUT, env=env)
        _wait_for(port_file, syncer)
        cmd = [sys.executable, __file__, "_island", str(work / "timings.json"),
               "--model", model, "--data", data, "--syncer", target, "--tuning", tuning,
               "--output", work / "island", *island_flags(args),
               *(["--pipeline", str(args.pipeline)] if fragments > 1 else [])]
        with open(work / "island.log", "w") as log:
            code = lab.popen(b, cmd, stdout=log, stderr=subprocess.STDOUT, env=env).wait()
        if code != 0:
            raise RuntimeError(f"the island failed ({code}):\n"
                               + (work / "island.log").read_text()[-3000:])
        syncer.wait(timeout=60)
    return measure(work, args.rate_mbit)


def _wait_for(port_file: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the syncer did not start (code {proc.poll()})")
        time.sleep(0.02)


def measure(work: Path, rate_mbit: float) -> dict:
    """Shares of the island's time blocked on the network, from its timings."""
    t = json.loads((work / "timings.json").read_text())
    summary = json.loads((work / "island" / "summary.json").read_text())
    lo, hi = t["trained_from"], t["trained_to"]
    in_training = sum(_overlap(w, (lo, hi)) for w in t["waits"])
    waited = sum(e - s for s, e in t["waits"])
    link_s = (summary["bytes_up"] + summary["bytes_down"]) * 8 / (rate_mbit * 1e6)
    run_s = t["end"] - t["joining"]
    # pushes in flight during training, and how much of that time the island was blocked
    flying = [(max(s, lo), min(e, hi)) for s, e in t["pushes"] if e > lo and s < hi]
    flying_s = sum(e - s for s, e in flying)
    blocked_s = sum(_overlap(f, w) for f in flying for w in t["waits"])
    return dict(wait_share=in_training / (hi - lo), wait_share_run=waited / run_s,
                train_s=hi - lo, run_s=run_s, wait_train_s=in_training,
                wait_s=waited, bytes_up=summary["bytes_up"], bytes_down=summary["bytes_down"],
                link_s=link_s, pushes=summary["pushes"], steps=summary["step"],
                in_flight_s=flying_s,
                trained_through=1 - blocked_s / flying_s if flying_s else float("nan"))


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


# ---- the island, instrumented (runs inside host b) ------------------------------------------
def island_main(out: str, argv: list[str]) -> int:
    """`python -m yeto.learner ARGV` with its network waits timed: every
    `SyncerClient.wait` call (where an island blocks for weights), every push from
    its start to the syncer's reply, when it joined, when it held the run's weights
    (training starts) and when its last push began."""
    import yeto.client as client
    import yeto.island as island
    from yeto.island.ledger import PushLedger
    from yeto.torch.learner import main

    t: dict = dict(waits=[], pushes=[])
    wait, start, finish = client.SyncerClient.wait, island.Island.start, island.Island.finish
    push, settle = client.SyncerClient.push, PushLedger.settle

    def timed_settle(self, *a, **kw):  # waiting for push replies blocks training too
        blocking = a[1] if len(a) > 1 else kw.get("wait", False)
        t0 = time.time()
        try:
            return settle(self, *a, **kw)
        finally:
            if blocking:
                t["waits"].append((t0, time.time()))

    def timed_push(self, *a, **kw):
        t0 = time.time()
        fut = push(self, *a, **kw)
        fut.add_done_callback(lambda _: t["pushes"].append((t0, time.time())))
        return fut

    def timed_wait(self, *a, **kw):
        t0 = time.time()
        try:
            return wait(self, *a, **kw)
        finally:
            t["waits"].append((t0, time.time()))

    def timed_start(self):
        t["joining"] = time.time()
        start(self)
        t["trained_from"] = time.time()

    def timed_finish(self):
        t["trained_to"] = time.time()
        return finish(self)

    client.SyncerClient.wait, island.Island.start = timed_wait, timed_start
    client.SyncerClient.push = timed_push
    island.Island.finish = timed_finish
    PushLedger.settle = timed_settle
    code = main(argv)
    t["end"] = time.time()
    Path(out).write_text(json.dumps(t))
    return code


# ---- report -------------------------------------------------------------------------------
def report(results: dict, args) -> str:
    rows = [[tuning, p, f"{r['wait_share']:.2%}", f"{r['wait_share_run']:.2%}",
             f"{r['train_s']:.1f}", f"{r['wait_train_s']:.2f}", f"{r['bytes_up'] / 1e6:.2f}",
             f"{r['bytes_down'] / 1e6:.2f}", f"{r['link_s']:.1f}", f"{r['in_flight_s']:.1f}",
             f"{r['trained_through']:.0%}", r["pushes"]] for (tuning, p), r in results.items()]
    print_table(["weights", "P", "wait/training", "wait/run", "training s", "wait s (train)",
                 "MB up", "MB down", "link s", "push in flight s", "trained through",
                 "pushes"], rows, right=range(1, 12))
    lora, full = results[("lora", 1)], results[("full", 1)]
    lora4, full4 = results[("lora", 4)], results[("full", 4)]
    print(f"\nlink {args.rate_mbit:g} Mbit/s each way, {args.delay_ms:g} ms one-way, downlink "
          f"{args.downlink or 'f32'}, P=4 pipeline {args.pipeline}; goal: LoRA "
          f"<= 1 % ({'met' if lora['wait_share'] <= 0.01 else 'missed'}); full weights with "
          f"P=4 < 5 % ({'met' if full4['wait_share'] < 0.05 else 'missed'}; P=1: "
          f"{full['wait_share']:.2%})")
    return result_line(wait_share=lora["wait_share"], wait_share_P4=full4["wait_share"],
                       wait_share_full=full["wait_share"], wait_share_lora_P4=lora4["wait_share"],
                       wait_share_run=lora["wait_share_run"],
                       wait_share_P4_run=full4["wait_share_run"],
                       wait_share_full_run=full["wait_share_run"], rate_mbit=args.rate_mbit,
                       delay_ms=args.delay_ms, goal_wait_share="<=0.01",
                       goal_wait_share_P4="<0.05")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_island"]:
        return island_main(argv[1], argv[2:])
    args = parse_args(argv)
    why = netlab.unavailable() or netlab.tc_unavailable()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    from yeto.testing.tasks import make_task
    from yeto.testing.tiny import make_tiny_model

    work = args.out or Path(tempfile.mkdtemp(prefix="bench-link-"))
    model = args.model or make_tiny_model(work / "model", "llama")
    data, _ = make_task(work / "data")
    results = {}
    for tuning, p in ARMS:
        t0 = time.monotonic()
        results[(tuning, p)] = r = run_arm(args, model, data, tuning, p, work / f"{tuning}-P{p}")
        print(f"{tuning} P={p}: wait {r['wait_share']:.2%} of training, "
              f"{r['wait_share_run']:.2%} of the run ({time.monotonic() - t0:.0f} s)", flush=True)
    print(report(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
