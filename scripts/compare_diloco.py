"""Does DiLoCo learn? DiLoCo against synchronous data-parallel on the same budget.

Every arm trains the same tiny model (--real: a real one) on the same data with the same total token
budget (k islands x steps x batch = single-island steps x batch), as real processes
(a `python -m syncer` and `python -m yeto.learner` islands, one torch thread each),
one arm at a time. Each (arm, seed) result is cached as JSON under --out, so a
rerun resumes where it stopped (delete a file, or pass --fresh, to redo it).

Arms
  single          one island, batch b, N steps.
  dp<k>           synchronous data-parallel: one island with batch k*b for N/k steps.
                  Equivalent to k islands that average gradients every step: each
                  island's gradient is the gradient of its mean loss over b blocks;
                  the mean of k such gradients over equal-size batches is the gradient
                  of the mean loss over the k*b blocks (the loss is a mean, the gradient
                  linear), so AdamW, fed the same gradient from the same state, takes
                  the identical step. (The islands normalise by loss tokens, so this is
                  exact when every island's batch has as many loss tokens; close
                  otherwise.)
  diloco<k>-H<H>-<wire>   k islands, N/k steps each, push every H steps on <wire>;
                  token-weighted mean, outer step lr 1 momentum 0 (plain averaging:
                  the rule the evidence picked, see BENCHMARKS.md), f32 downlink,
                  islands train on while a round commits (the learner's default).
                  Suffixes: -nest outer Nesterov 0.7/0.9 (the DiLoCo paper's);
                  -m05 outer lr 0.7 momentum 0.5; -o04 outer lr 0.4 momentum 0.9;
                  -lr<LR>m<M> outer lr LR/10 momentum M/10; -rda norm-preserving merge; -dq4
                  q4 downlink; -frozenA LoRA A frozen (--lora-freeze-a); -blk
                  --blocking-sync; -P<p> streaming, the syncer's --fragments p.
  nomerge<k>      k islands that never merge (--syncer none); the mean of their
                  held-out losses.
  mixed-steps / mixed-time   two islands, one at --slowdown 3, syncing every H steps
                  or every T seconds, on the same wall-clock budget (see mixed_arms).
  Regime "full" (from scratch, full weights, stdlib source) adds single (N/k steps:
  the DiLoCo paper's Table 2 baseline, 1/k of the tokens) and single-same-tokens.

Columns
  eval      held-out loss of the final weights (mean over seeds; +- half the range)
  ratio     eval / eval of the arm's synchronous reference (dp<k>, same seed)
  up, down  bytes on the wire from the syncer's tape: sum of bytes_in / bytes_out of
            its merge records (dp rows: the modelled ring all-reduce, see below)
  B/tok vs AR   (bytes_up + bytes_down) per trained token / bytes per trained token
            of a synchronous ring all-reduce of the same trainable parameters P
            over the same k islands. A ring all-reduce sends, per island per step,
            2(k-1)/k * 4 bytes * P (reduce-scatter + all-gather, f32); an island
            trains b*L tokens per step, so
                AR bytes = tokens * 2(k-1)/k * 4 * P / (b * L)
            Every byte a ring island sends is one another receives, so each wire
            byte is counted once on both sides. "x fewer" = 1 / that ratio.

Goals (each reported with met=yes|no)
  - DiLoCo k=4, q4 wire, H >= 50: eval <= 1.01 x dp4 at >= 500x fewer bytes/token.
  - q4 within 0.3% of f32 held-out loss (same k, H).
  - Regime full (from scratch): diloco4 <= dp4, both below the single island (the
    DiLoCo paper's Table 2 baseline: one island, as many steps, 1/k of the tokens).

Goals of --rules (the arms: yeto/testing/diloco_arms.py), per outer rule
  - short LoRA (8 rounds) <= 1.03 x dp4; long warm k = 4 and 8 <= 1.00 x dp<k> at >= 400x
    fewer bytes per token; from scratch and the larger model (warm2m: warm, k = 4, H = 100
    on the >2M-parameter "small" tiny model) reported against the same goal.

Goals of --real: LoRA r16 on SmolLM2-135M-Instruct (a real pretrained model,
its GGUF file) and real text (standard-library docstrings), the default outer rule at
k = 2 and k = 4 (4 rounds each) <= 1.03 x dp<k> on the same tokens; plain averaging
reported beside it.

Usage
  python scripts/compare_diloco.py --real --jobs 1      # real model and text (~45 min)
  python scripts/compare_diloco.py --quick        # the default rule's short cell, 3 seeds
  python scripts/compare_diloco.py --rules --jobs 2   # every outer rule x regime, 3 seeds
  python scripts/compare_diloco.py --rules --arms 'warm2m:*warmup' --seeds 0,1  # larger model
  python scripts/compare_diloco.py --rules --arms 'warm2m:*warmup' --seeds 0 \
      --max-steps 300 --out /tmp/cmp2m     # the same arms for 3 rounds: a time per round
  python scripts/compare_diloco.py                # every arm, 2 seeds (about an hour+)
  python scripts/compare_diloco.py --arms 'lora:diloco4*' --seeds 0,1
  python scripts/compare_diloco.py --smoke --out /tmp/cmp   # 2 arms, a few steps
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from syncer.spawn import SyncerStartError, start_syncer  # noqa: E402
from yeto.io import atomic_write  # noqa: E402
from yeto.testing.diloco_arms import (  # noqa: E402
    DATA_VERSION,
    Arm,
    Regime,
    capped,
    choose,
    config_of,
    plan,
)
from yeto.testing.diloco_report import Row, report  # noqa: E402

PY = sys.executable
EVAL_EVERY = 50  # held-out loss every this many steps on islands without a syncer


# ---------------------------------------------------------------- data


def prepare(out: Path, rg: Regime) -> tuple[Path, Path, Path]:
    """(model dir, train.jsonl, eval.jsonl) for a regime; built once under out/ (a real
    base: its GGUF file read once into the cached model dir, `yeto.gguf.model_dir`)."""
    from yeto.testing.tasks import make_task

    model = base_model(out, rg)
    d = out / "data" / f"{rg.data}-v{DATA_VERSION}"
    train = d / "train.jsonl"
    held_out = d / ("held_out.jsonl" if rg.data == "docs" else "eval.jsonl")
    if not (train.is_file() and held_out.is_file()):
        if rg.data == "docs":  # real text: standard-library docstrings (yeto.testing.real)
            from yeto.testing.real import stdlib_docs

            d.mkdir(parents=True, exist_ok=True)
            assert stdlib_docs(d) == (train, held_out)
        elif rg.data == "task":
            tmp_train, tmp_eval = make_task(d, n_train=8000, n_eval=200)
            assert (tmp_train, tmp_eval) == (train, held_out)
        else:
            stdlib_rows(d)
    return model, train, held_out


def base_model(out: Path, rg: Regime) -> Path:
    """The model dir a regime trains: its real base (a GGUF file through the cache, or a
    model dir as it is), else the tiny model of its size, built once under out/models."""
    if rg.base:
        from yeto.gguf import is_gguf, model_dir

        return model_dir(rg.base) if is_gguf(rg.base) else Path(rg.base)
    from yeto.testing.tiny import make_tiny_model

    name = ("pretrained" if rg.pretrain else "scratch") + ("" if rg.size == "tiny"
                                                          else f"-{rg.size}")
    return make_tiny_model(out / "models" / name, pretrain=rg.pretrain, size=rg.size)


def stdlib_rows(d: Path, eval_files: int = 20, eval_pieces: int = 3,
                train_chars: int = 4_000_000, row_chars: int = 2000) -> None:
    """Rows {"text": ...} of Python standard library source (top-level *.py files, cut
    at line ends into ~row_chars pieces). Held-out files are disjoint from training
    files: every 7th file past those the tiny tokenizer was trained on
    (`yeto.testing.tokenizer.stdlib_text`, the first 400k characters), their first
    `eval_pieces` pieces each."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[tuple[str, str]] = []
    for p in sorted(root.glob("*.py")):
        try:
            texts.append((p.name, p.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError):
            continue
    seen, first_unseen = 0, len(texts)
    for i, (_, t) in enumerate(texts):
        seen += len(t)
        if seen >= 400_000:
            first_unseen = i + 1
            break
    held = {name for name, _ in texts[first_unseen::7][:eval_files]}
    train_rows, eval_rows, size = [], [], 0
    for name, t in texts:
        pieces = _pieces(t, row_chars)
        if name in held:
            eval_rows += pieces[:eval_pieces]
        elif size < train_chars:
            train_rows += pieces
            size += len(t)
    d.mkdir(parents=True, exist_ok=True)
    atomic_write(d / "eval.jsonl", "".join(json.dumps({"text": x}) + "\n" for x in eval_rows))
    atomic_write(d / "train.jsonl", "".join(json.dumps({"text": x}) + "\n" for x in train_rows))
    atomic_write(d / "files.json", json.dumps({"eval": sorted(held)}, indent=1))


def _pieces(text: str, size: int) -> list[str]:
    out, cur = [], []
    n = 0
    for line in text.splitlines(keepends=True):
        cur.append(line)
        n += len(line)
        if n >= size:
            out.append("".join(cur))
            cur, n = [], 0
    if "".join(cur).strip():
        out.append("".join(cur))
    return out


# ---------------------------------------------------------------- running


def arm_env() -> dict:
    """The environment of an arm's processes: one thread each, unbuffered logs."""
    return dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
                OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


class ArmFailed(RuntimeError):
    pass


def run_arm(arm: Arm, rg: Regime, seed: int, paths, run_dir: Path, timeout: float) -> dict:
    """Run one (arm, seed) as real processes: a syncer (DiLoCo arms) and the islands;
    DiLoCo arms of a regime with `sim` in one `python -m yeto.sim` process."""
    if rg.sim and arm.kind == "diloco":
        return run_sim_arm(arm, rg, seed, paths, run_dir, timeout)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    env = arm_env()
    procs: list[subprocess.Popen] = []
    syncer = None
    t0 = time.monotonic()
    try:
        if arm.kind in ("diloco", "mixed"):
            syncer = _start_syncer(arm, run_dir / "syncer", env)
        address = syncer.address if syncer is not None else "none"
        n_proc = 1 if arm.kind in ("single", "dp") else arm.k
        for i in range(n_proc):
            d = run_dir / "islands" / f"island-{i}"
            d.mkdir(parents=True)
            procs.append(subprocess.Popen(island_cmd(arm, rg, seed, paths, i, n_proc, address, d),
                                          stdout=open(d / "log.txt", "w"),
                                          stderr=subprocess.STDOUT, env=env, cwd=ROOT))
        _wait_islands(arm, seed, procs, run_dir, t0 + timeout)
        wall = time.monotonic() - t0
        if syncer is not None:
            syncer.stop(grace_s=60)  # it exits by itself once the final weights went out
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
        if syncer is not None:
            syncer.stop(term_timeout_s=10)
    return summarize(arm, rg, run_dir, wall)


def _start_syncer(arm: Arm, sdir: Path, env: dict):
    sdir.mkdir()
    try:
        return start_syncer(
            ["--quorum", str(arm.k), "--state-dir", str(sdir), *syncer_args(arm)],
            cwd=ROOT, env=env, log=sdir / "log.txt", timeout_s=120)
    except SyncerStartError as e:
        raise ArmFailed(f"{arm.key}: {e}") from None


def island_args(arm: Arm, rg: Regime, seed: int, paths) -> list[str]:
    """The flags every island of an arm takes (`python -m yeto.learner` / `yeto.sim`)."""
    model, train, held_out = paths
    return ["--model", str(model), "--data", str(train), "--eval-data", str(held_out),
            "--eval-blocks", str(rg.eval_blocks), "--batch-size", str(arm.batch),
            "--seq-len", str(rg.seq_len),
            "--inner-lr", str(rg.inner_lr), "--tuning", rg.tuning,
            "--lora-r", str(rg.lora_r), "--lora-alpha", str(2 * rg.lora_r),
            # without a syncer, H only sets how often the island evaluates
            "--sync-every", str(arm.H or EVAL_EVERY), "--wire", arm.wire,
            "--seed", str(seed), "--threads", "1", "--no-progress", *arm.extra]


def syncer_args(arm: Arm) -> list[str]:
    return ["--outer", arm.outer, "--outer-lr", str(arm.outer_lr),
            "--outer-momentum", str(arm.outer_momentum), "--merge", arm.merge,
            "--downlink", arm.downlink, *arm.syncer_extra]


def island_cmd(arm: Arm, rg: Regime, seed: int, paths, i: int, n_proc: int, address: str,
               d: Path) -> list[str]:
    cmd = [PY, "-m", "yeto.learner", *island_args(arm, rg, seed, paths),
           "--syncer", address, "--learner-id", f"island-{i}",
           "--num-learners", str(n_proc), "--max-steps", str(arm.steps_of(i)),
           "--output", str(d)]
    return cmd + list(arm.per_island[i]) if arm.per_island else cmd


def run_sim_arm(arm: Arm, rg: Regime, seed: int, paths, run_dir: Path, timeout: float) -> dict:
    """A DiLoCo arm as one `python -m yeto.sim` process: the same islands, syncer and
    outputs as real processes (tests/e2e/test_sim.py), a fraction of the overhead."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    env = arm_env()
    cmd = [PY, "-m", "yeto.sim", *island_args(arm, rg, seed, paths), "--islands", str(arm.k),
           "--max-steps", str(arm.steps), "--grace-ms", "0", "--out", str(run_dir),
           "--log-level", "INFO", *syncer_args(arm)]
    t0 = time.monotonic()
    with open(run_dir / "sim.log", "w") as log:
        try:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            raise ArmFailed(f"{arm.key} seed {seed}: still running at the arm's timeout; "
                            f"see {run_dir}") from None
    if code:
        raise ArmFailed(f"{arm.key} seed {seed}: yeto.sim exited {code}:\n"
                        + _tail(run_dir / "sim.log"))
    shutil.copy(run_dir / "sim.log", run_dir / "islands" / "island-0" / "log.txt")
    return summarize(arm, rg, run_dir, time.monotonic() - t0)


def _wait_islands(arm: Arm, seed: int, procs, run_dir: Path, deadline: float) -> None:
    for i, p in enumerate(procs):
        try:
            code = p.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            raise ArmFailed(f"{arm.key} seed {seed}: island-{i} still running at the arm's "
                            f"timeout; see {run_dir}") from None
        if code:
            raise ArmFailed(f"{arm.key} seed {seed}: island-{i} exited {code}:\n"
                            + _tail(run_dir / "islands" / f"island-{i}" / "log.txt"))


def summarize(arm: Arm, rg: Regime, run_dir: Path, wall: float) -> dict:
    islands = sorted((run_dir / "islands").iterdir())
    summ = [json.loads((d / "summary.json").read_text()) for d in islands]
    params = _params(islands[0] / "log.txt")
    losses = [s["eval_loss"] for s in summ]
    steps = [s["step"] for s in summ]
    stopped = [i for i, st in enumerate(steps) if st < arm.steps_of(i)]
    if stopped and arm.kind != "mixed":  # stopped early (a signal): not a result
        raise ArmFailed(f"{arm.key}: island-{stopped[0]} stopped at step {steps[stopped[0]]} "
                        f"of {arm.steps_of(stopped[0])}; see {run_dir}")
    tokens = sum(st * arm.batch * rg.seq_len for st in steps)
    res = dict(eval_loss=statistics.fmean(losses), eval_losses=losses,
               eval_loss_before=summ[0]["eval_loss_before"], steps=steps,
               loss_tokens=[s["loss_tokens"] for s in summ], tokens=tokens, params=params,
               wall_s=round(wall, 1), final=[s.get("final") for s in summ],
               wait_s=[round(s.get("wait_s", 0.0), 1) for s in summ],
               client_bytes_up=sum(s.get("bytes_up", 0) for s in summ),
               client_bytes_down=sum(s.get("bytes_down", 0) for s in summ))
    k = arm.k
    # a synchronous ring all-reduce over the same k islands, for the same tokens; a dp
    # arm is one process standing for k islands of batch b = its batch / k
    b = arm.batch // k if arm.kind == "dp" else arm.batch
    ar = tokens * 2 * (k - 1) / k * 4 * params / (b * rg.seq_len) if k > 1 else 0.0
    res["ar_bytes"] = ar
    res["curve"] = _curve(islands[0] / "metrics.jsonl")
    up = down = 0
    shares: dict[str, list[float]] = {}
    tape_tokens: dict[str, int] = {}
    tape = run_dir / "syncer" / "tape.jsonl"
    if tape.exists():
        from syncer.tape import read_tape

        merges = [r for r in read_tape(tape) if r.get("event") == "merge"]
        up = sum(r["bytes_in"] for r in merges)
        down = sum(r["bytes_out"] for r in merges)
        for r in merges:
            for x in r["responders"]:
                shares.setdefault(x["learner"], []).append(x["share"])
                tape_tokens[x["learner"]] = tape_tokens.get(x["learner"], 0) + x["tokens"]
        res.update(rounds=len(merges), rejected=sum(1 for r in read_tape(tape)
                                                     if r.get("event") == "rejected"))
        res["share_mean"] = {k_: statistics.fmean(v) for k_, v in shares.items()}
        res["tape_tokens"] = tape_tokens
        res["distinct_final_losses"] = len({round(x, 6) for x in losses})
    if arm.kind == "dp":
        up = down = int(ar)
    res.update(bytes_up=up, bytes_down=down)
    # dp: 1 by definition (its wire is the all-reduce itself)
    res["bytes_per_token_ratio"] = 1.0 if arm.kind == "dp" else (up + down) / ar if ar else 0.0
    return res


def _curve(path: Path) -> list[list[float]]:
    """(step, held-out loss) of island-0 as it trained (its local weights at each sync)."""
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            loss = r.get("eval_loss")
            if "step" in r and isinstance(loss, (int, float)) and math.isfinite(loss):
                out.append([r["step"], round(loss, 4)])
    return out


def _params(log: Path) -> int:
    m = re.search(r"trainable tensors, (\d+) parameters", log.read_text(errors="replace"))
    if not m:
        raise ArmFailed(f"no parameter count in {log}")
    return int(m.group(1))


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


# ---------------------------------------------------------------- report


# ---------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help="the default outer rule's short LoRA cell (k=4, H=50, 8 rounds, "
                           "q4 both ways) and dp4, 3 seeds, and the default's goal lines "
                           "(cells of the --rules table it did not run say so); shares "
                           "--rules' cache")
    mode.add_argument("--rules", action="store_true",
                      help="the outer-rule candidates (yeto/testing/diloco_arms.py) in three "
                           "regimes: short LoRA (8 rounds), long warm (k=4 and 8, H=100), "
                           "long from scratch (k=4, H=50 and 100), q4 both ways, 3 seeds, "
                           "each cell's ratio to data-parallel on the same tokens; and the "
                           "larger model (warm2m: warm k=4 H=100 on the >2M-parameter small "
                           "tiny model, dp4 and the avg and warmup rules only)")
    mode.add_argument("--long", action="store_true",
                      help="DiLoCo's own regime: full weights on stdlib source, warm start "
                           "(the briefly pretrained tiny model) and from scratch, 5000 inner "
                           "steps per island (100 rounds at H=50), DiLoCo arms through "
                           "python -m yeto.sim; k, H and outer-optimizer sweeps at that "
                           "per-island budget")
    mode.add_argument("--real", action="store_true",
                      help="LoRA (r16) on a real pretrained model (--model, default "
                           "SmolLM2-135M-Instruct) and real text (standard-library "
                           "docstrings, held out by module), k=2 and 4 islands, 4 rounds, the "
                           "default outer rule and plain averaging against dp<k> on the same "
                           "tokens, DiLoCo arms through python -m yeto.sim, 2 seeds")
    mode.add_argument("--smoke", action="store_true",
                      help="2 arms, a few steps, 1 seed (< 60 s): checks the plumbing")
    p.add_argument("--out", type=Path, default=None,
                   help="cache and run folder (default runs/compare, runs/compare-rules "
                        "(--rules and --quick), runs/compare-long, runs/compare-real, "
                        "runs/compare-smoke)")
    p.add_argument("--model", default=None, metavar="FILE.gguf|DIR",
                   help="--real's base: a GGUF file or a model dir (default: SmolLM2-135M-"
                        "Instruct, `python -m yeto.testing.real --fetch`); part of each "
                        "result's cache key")
    p.add_argument("--arms", default=None,
                   help="comma list of glob patterns over regime:arm names, e.g. "
                        "'lora:diloco4*,full:*' (default: all of the mode's)")
    p.add_argument("--seeds", default=None,
                   help="comma list of seeds (default 0,1; --rules and --quick 0,1,2)")
    p.add_argument("--jobs", type=int, default=1,
                   help="(arm, seed) runs at once, each its own processes")
    p.add_argument("--fresh", action="store_true", help="ignore cached results")
    p.add_argument("--report-only", action="store_true",
                   help="print the tables from cached results; run nothing")
    p.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    p.add_argument("--arm-timeout", type=float, default=1800, help="seconds per arm run")
    p.add_argument("--max-steps", type=int, default=None, metavar="N",
                   help="at most N steps per island in every arm (a check of the plumbing "
                        "and of the time per round, not a result to report; cached apart, "
                        "since the steps are part of each result's key)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    mode_name = ("smoke" if args.smoke else "quick" if args.quick else "long" if args.long
                 else "rules" if args.rules else "real" if args.real else "full")
    out = (args.out or ROOT / "runs" / ("compare" if mode_name == "full" else "compare-rules"
                                        if mode_name == "quick"
                                        else f"compare-{mode_name}")).resolve()
    if args.model and mode_name != "real":
        raise SystemExit("--model: only --real takes a model (the other modes train the "
                         "tiny one)")
    regimes, arms, seeds = plan(mode_name, args.model)
    missing = [rg.base for rg in regimes.values() if rg.base and not Path(rg.base).exists()]
    if missing:
        raise SystemExit(f"--model {missing[0]}: not found (SmolLM2-135M-Instruct: "
                         "python -m yeto.testing.real --fetch)")
    if args.seeds:
        seeds = [int(s) for s in args.seeds.split(",")]
    arms = choose(arms, args.arms or "*")
    if args.max_steps is not None:
        arms = capped(arms, args.max_steps)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows: dict[str, Row] = {a.key: Row(a) for a in arms}
    todo = []  # (arm, seed, cache path, digest) not cached yet
    for arm, seed in itertools.product(arms, seeds):
        cfg = config_of(arm, regimes[arm.regime], seed)
        digest = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]
        cache = out / "results" / arm.regime / f"{digest}.json"
        saved = None if args.fresh else cached(cache, digest)
        if saved is not None:
            rows[arm.key].results[seed] = saved
        elif not args.report_only:
            todo.append((arm, seed, cache, digest))
    skipped = run_all(todo, regimes, rows, out, args)
    report(rows, regimes, skipped, args.markdown)
    return 0


def run_all(todo: list, regimes: dict[str, Regime], rows: dict[str, Row], out: Path,
            args) -> list[str]:
    """Run each (arm, seed) of `todo`, --jobs at a time, in order; cache each result.
    Returns the failed ones."""
    paths = {name: prepare(out, regimes[name]) for name in {a.regime for a, *_ in todo}}
    t_start, skipped = time.monotonic(), []

    def one(item) -> None:
        arm, seed, cache, digest = item
        run_dir = out / "runs" / arm.regime / arm.name / f"seed{seed}"
        with claimed(run_dir) as mine:  # another runner on the same --out has it
            if not mine or cached(cache, digest) is not None:
                print(f"  {arm.key} seed {seed}: run by another runner, skipped", flush=True)
                return
            print(f"[{time.monotonic() - t_start:6.0f}s] running {arm.key} seed {seed} ...",
                  flush=True)
            try:
                res = run_arm(arm, regimes[arm.regime], seed, paths[arm.regime], run_dir,
                              args.arm_timeout)
            except ArmFailed as e:
                print(f"  FAILED: {e}", flush=True)
                skipped.append(f"{arm.key} seed {seed} (failed)")
                return
        print(f"  {arm.key} seed {seed}: eval {res['eval_loss']:.4f} (before "
              f"{res['eval_loss_before']:.4f}), {res.get('rounds', 0)} rounds, "
              f"{res['wall_s']:.0f}s", flush=True)
        rows[arm.key].results[seed] = res
        atomic_write(cache, json.dumps({"digest": digest, "arm": arm.name,
                                        "config": config_of(arm, regimes[arm.regime], seed),
                                        "result": res}, indent=1))

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        list(pool.map(one, todo))
    return skipped


@contextlib.contextmanager
def claimed(run_dir: Path):
    """Yields whether this process holds `run_dir`'s claim (a file with its pid, made
    exclusively; taken over from a pid that no longer runs), so runners sharing an --out
    never run one (arm, seed) twice at once."""
    claim = run_dir.parent / f"{run_dir.name}.claim"
    claim.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                os.kill(int(claim.read_text() or 0), 0)
                yield False  # its owner runs
                return
            except (ProcessLookupError, ValueError, FileNotFoundError):
                claim.unlink(missing_ok=True)  # a dead runner's: take it over
                continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        try:
            yield True
        finally:
            claim.unlink(missing_ok=True)
        return
    yield False


def cached(cache: Path, digest: str) -> dict | None:
    """A cached (arm, seed) result, if there is one for this exact configuration."""
    if not cache.is_file():
        return None
    saved = json.loads(cache.read_text())
    return saved["result"] if saved.get("digest") == digest else None


if __name__ == "__main__":
    sys.exit(main())
