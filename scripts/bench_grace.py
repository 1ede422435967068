"""A mixed-speed fleet: sync by steps or by wall time, and the syncer's grace rules.

Three islands at speeds 1, 1, 3 (`python -m yeto.sim --speeds`: the third sleeps so
that each of its steps takes three times as long; it trains a third of the steps, so
all three train for the same wall time), full weights of the briefly pretrained tiny
model on standard-library source (the `compare_diloco.py --long` regime), one
process per arm. Arms:

  steps  all       sync every H steps, quorum 3: every round waits for the slow island
  steps  grace 0   quorum 2, no grace: rounds commit with the two fast islands
  steps  500 ms    quorum 2, the default fixed grace
  steps  auto      quorum 2, `--grace auto` (syncer/grace.py)
  time   0 / auto  every island pushes every T seconds (`--sync-every-seconds`), quorum 2

Reported per arm: held-out loss at the end, rounds, wall seconds, goodput (the share
of the islands' time spent training rather than waiting for a round: 1 - wait / wall,
over all islands), pushes refused (e.g. too stale), and the share of the tokens the
islands trained on that reached Θ through a merge (a refused push's tokens never do).
Speeds are real sleeps, so wall times are those of this machine under its load; one
seed. Last line:
    RESULT best=<arm> eval_loss=... goodput=...
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from _bench import ROOT, parser
from compare_diloco import arm_env, plan, prepare

from syncer.tape import read_tape
from yeto.cli.display import print_table

H, T = 50, 2.0
ARMS = {  # name: (sync flags, syncer flags)
    "steps all": ([], ["--quorum", "3"]),
    "steps grace 0": ([], ["--quorum", "2", "--grace-ms", "0"]),
    "steps 500 ms": ([], ["--quorum", "2", "--grace-ms", "500"]),
    "steps auto": ([], ["--quorum", "2", "--grace", "auto"]),
    "time grace 0": (["--sync-every-seconds", str(T)], ["--quorum", "2", "--grace-ms", "0"]),
    "time auto": (["--sync-every-seconds", str(T)], ["--quorum", "2", "--grace", "auto"]),
}


def run_arm(name: str, steps: int, paths, out: Path, reuse: bool) -> dict:
    if not (reuse and (out / "summary.json").is_file()):
        simulate(name, steps, paths, out)
    summary = json.loads((out / "summary.json").read_text())
    tape = read_tape(out / "syncer" / "tape.jsonl")
    merged = sum(s["tokens"] for e in tape if e["event"] == "merge" for s in e["responders"])
    islands = summary["islands"].values()
    trained = sum(i["loss_tokens"] for i in islands)
    waited = sum(i["wait_s"] for i in islands) / (len(islands) * summary["seconds"])
    refused = sum(e["event"] == "rejected" and e.get("kind") != "duplicate" for e in tape)
    return dict(arm=name, eval=summary["eval_loss"], rounds=summary["rounds"],
                wall=summary["seconds"], refused=refused, goodput=1 - waited,
                merged=merged / max(trained, 1))


def simulate(name: str, steps: int, paths, out: Path) -> None:
    model, train, held_out = paths
    sync, syncer = ARMS[name]
    cmd = [sys.executable, "-m", "yeto.sim", "--model", str(model), "--data", str(train),
           "--eval-data", str(held_out), "--eval-blocks", "64", "--tuning", "full",
           "--batch-size", "4", "--seq-len", "32", "--inner-lr", "1e-3", "--wire", "q4",
           "--sync-every", str(H), *sync, "--islands", "3", "--speeds", "1,1,3",
           "--max-steps", str(steps), "--threads", "1", "--seed", "0", "--no-progress",
           "--out", str(out), *syncer]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=arm_env())
    if r.returncode:
        raise SystemExit(f"{name}: yeto.sim exited {r.returncode}:\n{r.stderr[-3000:]}")


def main() -> int:
    p = parser(__doc__.split("\n\n")[0], __doc__.split("\n\n", 1)[1])
    p.add_argument("--steps", type=int, default=1000, help="steps of a full-speed island")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-grace")
    p.add_argument("--arms", default=",".join(ARMS), help="comma list of arm names")
    p.add_argument("--reuse", action="store_true",
                   help="report arms whose summary.json is already in --out without rerunning")
    args = p.parse_args()
    steps = 150 if args.quick else args.steps
    regimes, _, _ = plan("long")
    paths = prepare(ROOT / "runs" / "compare-long", regimes["warm"])
    rows = []
    for name in [a.strip() for a in args.arms.split(",") if a.strip()]:
        res = run_arm(name, steps, paths, args.out / name.replace(" ", "-"), args.reuse)
        print(f"{name}: eval {res['eval']:.4f}, {res['rounds']} rounds, "
              f"{res['wall']:.0f} s, goodput {res['goodput']:.3f}", flush=True)
        rows.append(res)
    print_table(["arm", "held-out loss", "rounds", "wall s", "goodput", "refused",
                 "tokens merged"],
                [[r["arm"], f"{r['eval']:.4f}", r["rounds"], f"{r['wall']:.0f}",
                  f"{r['goodput']:.3f}", r["refused"], f"{r['merged']:.3f}"] for r in rows],
                title=f"3 islands at speeds 1, 1, 3; H = {H} steps or T = {T} s; "
                      f"{steps} steps at full speed")
    best = min(rows, key=lambda r: r["eval"])
    print(f"RESULT best={best['arm'].replace(' ', '_')} eval_loss={best['eval']:.4f} "
          f"goodput={best['goodput']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
