"""A mixed-speed fleet: sync by steps or by wall time, and the syncer's grace rules.

Three islands at speeds 1, 1, 3 on simulated time (`python -m yeto.sim --speeds
--step-seconds S`: a step costs S simulated seconds, 3S on the slow island, which trains
a third of the steps, so all three train for the same simulated time), full weights of
the briefly pretrained tiny model on standard-library source (the `compare_diloco.py
--long` regime), one process per arm and seed. Arms:

  steps  all       sync every H steps, quorum 3: every round waits for the slow island
  steps  grace 0   quorum 2, `--grace fixed --grace-ms 0`: rounds commit with the two
                   fast islands
  steps  500 ms    quorum 2, `--grace fixed --grace-ms 500`
  steps  auto      quorum 2, `--grace auto` (syncer/grace.py)
  time   0 / auto  every island pushes every T simulated seconds (`--sync-every-seconds`),
                   quorum 2

With S = T / H a fast island pushes every H steps either way; the slow one every H steps
(3T) by steps, every H/3 steps (T) by time. Reported per arm (mean and half the range
over seeds): held-out loss at the end, rounds, simulated seconds to the last step,
goodput (the share of an island's simulated time, up to its last step, spent training
rather than waiting for a round; mean over islands), pushes refused (e.g. too stale),
and the share of the tokens the islands trained on that reached Θ through a merge (a
refused push's tokens never do). Simulated time makes a run repeat exactly: the rows
do not depend on this machine's load. Last line:
    RESULT best=<arm> eval_loss=... goodput=...
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from _bench import ROOT, parser, result_line
from compare_diloco import arm_env, prepare

from syncer.tape import read_tape
from yeto.display import print_table
from yeto.testing.diloco_arms import plan

H, T = 50, 2.0
S = T / H  # simulated seconds per step at full speed
ARMS = {  # name: (sync flags, syncer flags)
    "steps all": ([], ["--quorum", "3"]),
    "steps grace 0": ([], ["--quorum", "2", "--grace", "fixed", "--grace-ms", "0"]),
    "steps 500 ms": ([], ["--quorum", "2", "--grace", "fixed", "--grace-ms", "500"]),
    "steps auto": ([], ["--quorum", "2", "--grace", "auto"]),
    "time grace 0": (["--sync-every-seconds", str(T)],
                     ["--quorum", "2", "--grace", "fixed", "--grace-ms", "0"]),
    "time auto": (["--sync-every-seconds", str(T)], ["--quorum", "2", "--grace", "auto"]),
}


def run_arm(name: str, steps: int, seed: int, paths, out: Path, reuse: bool,
            jitter: float = 0.0) -> dict:
    """One arm and seed (rerun unless --reuse finds its summary)."""
    if not (reuse and (out / "summary.json").is_file()):
        simulate(name, steps, seed, paths, out, jitter)
    summary = json.loads((out / "summary.json").read_text())
    tape = read_tape(out / "syncer" / "tape.jsonl")
    merged = sum(s["tokens"] for e in tape if e["event"] == "merge" for s in e["responders"])
    trained = sum(i["loss_tokens"] for i in summary["islands"].values())
    refused = sum(e["event"] == "rejected" and e.get("kind") != "duplicate" for e in tape)
    goodput = summary["goodput"]
    full = sum(e["event"] == "merge" and len(e["responders"]) == 3 for e in tape)
    return dict(eval=summary["eval_loss"], rounds=summary["rounds"], full=full,
                simulated=summary["simulated_s"], refused=refused,
                goodput=sum(goodput.values()) / len(goodput), merged=merged / max(trained, 1))


def simulate(name: str, steps: int, seed: int, paths, out: Path, jitter: float) -> None:
    model, train, held_out = paths
    sync, syncer = ARMS[name]
    if out.exists():
        shutil.rmtree(out)  # a run's state is never overwritten silently: start clean
    cmd = [sys.executable, "-m", "yeto.sim", "--model", str(model), "--data", str(train),
           "--eval-data", str(held_out), "--eval-blocks", "64", "--tuning", "full",
           "--batch-size", "4", "--seq-len", "32", "--inner-lr", "1e-3", "--wire", "q4",
           "--sync-every", str(H), *sync, "--islands", "3", "--speeds", "1,1,3",
           "--step-seconds", str(S), "--step-jitter", str(jitter), "--max-steps", str(steps),
           "--threads", "1", "--seed", str(seed), "--no-progress", "--out", str(out), *syncer]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=arm_env())
    if r.returncode:
        raise SystemExit(f"{name}: yeto.sim exited {r.returncode}:\n{r.stderr[-3000:]}")


def spread(rows: list[dict], key: str) -> tuple[float, float]:
    """Mean and half the range over seeds."""
    xs = [r[key] for r in rows]
    return sum(xs) / len(xs), (max(xs) - min(xs)) / 2


def main() -> int:
    p = parser(__doc__.split("\n\n")[0], __doc__.split("\n\n", 1)[1])
    p.add_argument("--steps", type=int, default=2500, help="steps of a full-speed island")
    p.add_argument("--seeds", default="0,1", help="comma list of seeds")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-grace")
    p.add_argument("--arms", default=",".join(ARMS), help="comma list of arm names")
    p.add_argument("--step-jitter", type=float, default=0.0, metavar="J",
                   help="each step costs S x speed x a factor in [1 - J, 1 + J] (python -m "
                        "yeto.sim --step-jitter): islands of equal speed do not push at "
                        "the same instant")
    p.add_argument("--reuse", action="store_true",
                   help="report arms whose summary.json is already in --out without rerunning")
    args = p.parse_args()
    steps = 150 if args.quick else args.steps
    seeds = [int(x) for x in args.seeds.split(",")]
    regimes, _, _ = plan("long")
    paths = prepare(ROOT / "runs" / "compare-long", regimes["warm"])
    rows = []
    for name in [a.strip() for a in args.arms.split(",") if a.strip()]:
        runs = [run_arm(name, steps, seed, paths,
                        args.out / name.replace(" ", "-") / f"seed{seed}", args.reuse,
                        args.step_jitter)
                for seed in seeds]
        row = dict(arm=name, runs=runs, **{k: spread(runs, k) for k in runs[0]})
        print(f"{name}: eval {row['eval'][0]:.4f} +- {row['eval'][1]:.4f}, goodput "
              f"{row['goodput'][0]:.3f}", flush=True)
        rows.append(row)
    report(rows, steps, seeds, args.step_jitter)
    return 0


def report(rows: list[dict], steps: int, seeds: list[int], jitter: float) -> None:
    def pm(v: tuple[float, float], fmt: str) -> str:
        return f"{v[0]:{fmt}} +- {v[1]:{fmt}}"

    print_table(["arm", "held-out loss", "rounds", "3-push rounds", "simulated s", "goodput",
                 "refused", "tokens merged"],
                [[r["arm"], pm(r["eval"], ".4f"), f"{r['rounds'][0]:.0f}", f"{r['full'][0]:.1f}",
                  f"{r['simulated'][0]:.1f}", pm(r["goodput"], ".3f"), f"{r['refused'][0]:.0f}",
                  f"{r['merged'][0]:.3f}"] for r in rows],
                title=f"3 islands at speeds 1, 1, 3 on simulated time ({S:g} s a step, "
                      f"jitter {jitter:g}); "
                      f"H = {H} steps or T = {T:g} s; {steps} steps at full speed; seeds "
                      f"{','.join(map(str, seeds))}")
    best = min(rows, key=lambda r: r["eval"][0])
    print(result_line(best=best["arm"], eval_loss=best["eval"][0], goodput=best["goodput"][0]))


if __name__ == "__main__":
    sys.exit(main())
