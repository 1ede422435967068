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

Goals of --rules (the arms: scripts/_diloco_arms.py), per outer rule
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
import fnmatch
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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _diloco_arms import (  # noqa: E402
    CANDIDATES,
    CELLS,
    REAL_CELLS,
    Arm,
    Regime,
    candidate_of,
    cell_of,
    plan,
)

from syncer.spawn import SyncerStartError, start_syncer  # noqa: E402
from yeto.cli.display import markdown_table, table_text  # noqa: E402
from yeto.io import atomic_write  # noqa: E402

PY = sys.executable
EVAL_EVERY = 50  # held-out loss every this many steps on islands without a syncer
DATA_VERSION = 1  # bump when the prepared data change


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


def config_of(arm: Arm, rg: Regime, seed: int) -> dict:
    """What an arm's result depends on (its name and reference arm do not count)."""
    drop = {"name", "ref"} | ({"syncer_extra"} if not arm.syncer_extra else set())
    if arm.outer == "nesterov":  # the rule earlier caches ran: their digests hold
        drop.add("outer")
    if arm.kind not in ("diloco", "mixed"):  # no syncer: the outer settings do not apply
        drop |= {"H", "wire", "outer", "outer_lr", "outer_momentum", "merge", "downlink"}
    what = {k: v for k, v in asdict(arm).items() if k not in drop}
    regime = asdict(rg)
    if not rg.base:  # the tiny model, as every earlier cache: their digests hold; a real
        del regime["base"]  # base is keyed by its path (GGUF file or model dir)
    if rg.size == "tiny":  # the size every earlier cache ran: their digests hold
        del regime["size"]
    else:  # the base's cache key: a changed shape or pretraining recipe is a new result
        from yeto.testing.tiny import cache_key

        regime["model"] = cache_key("llama", 0, rg.pretrain, rg.size)
    return {"arm": what, "regime": regime, "seed": seed, "data": DATA_VERSION}


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


@dataclass
class Row:
    arm: Arm
    results: dict[int, dict] = field(default_factory=dict)  # seed -> result
    ratios: dict[int, float] = field(default_factory=dict)

    def mean(self, key: str) -> float:
        vals = [r[key] for r in self.results.values()]
        return statistics.fmean(vals) if vals else math.nan


def attach_ratios(rows: dict[str, Row]) -> None:
    """Each arm's ratio to its reference arm, per seed both ran; a seed whose reference
    ended unstable (`spiked`) has no ratio (the report says which)."""
    for row in rows.values():
        ref = rows.get(f"{row.arm.regime}:{row.arm.ref}") if row.arm.ref else None
        for seed, r in row.results.items():
            if ref is not None and seed in ref.results and not spiked(ref.results[seed]):
                row.ratios[seed] = r["eval_loss"] / ref.results[seed]["eval_loss"]


SPIKE = 0.05  # a final held-out loss this far above the run's own best: a spike


def spiked(res: dict) -> bool:
    """Whether a run's final held-out loss is more than SPIKE above the best it reached
    along the way (its curve): a reference that blew up at the end measures nothing."""
    best = min((x for _, x in res.get("curve", [])), default=None)
    return best is not None and res["eval_loss"] > best * (1 + SPIKE)


def spike_lines(rows: dict[str, Row]) -> list[str]:
    """The reference runs left out of the ratios as `spiked`."""
    refs = {f"{r.arm.regime}:{r.arm.ref}" for r in rows.values() if r.arm.ref}
    return [f"RESULT note=reference_spiked arm={key} seed={seed} eval_loss={res['eval_loss']:.4f} "
            f"best_on_the_way={min(x for _, x in res['curve']):.4f} (no ratio for this seed)"
            for key in sorted(refs & set(rows)) for seed, res in sorted(rows[key].results.items())
            if spiked(res)]


def fmt_bytes(b: float) -> str:
    if b <= 0:
        return "0"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"


# the numeric columns of the tables (right-aligned)
RIGHT_COLUMNS = (1, 2, 6, 7, 8, 10, 11, 12, 13, 14)


def print_tables(rows: dict[str, Row], regimes: dict[str, Regime], md: bool = False) -> None:
    headers = ["arm", "k", "H", "wire/down", "outer", "steps x b", "eval", "+-", "ratio", "vs",
               "up", "down", "B/tok vs AR", "x fewer", "wall s"]
    for name, rg in regimes.items():
        body = []
        for row in rows.values():
            a = row.arm
            if a.regime != name or not row.results:
                continue
            ev = [r["eval_loss"] for r in row.results.values()]
            bpt = row.mean("bytes_per_token_ratio")
            ratio = statistics.fmean(row.ratios.values()) if row.ratios else math.nan
            steps = "/".join(str(s) for s in a.island_steps) if a.island_steps else str(a.steps)
            outer = (f"{a.merge} {_rule(a)}{a.outer_lr:g}/{a.outer_momentum:g}"
                     if a.kind in ("diloco", "mixed") else "-")
            body.append([
                a.name, a.k, a.H or "-",
                f"{a.wire}/{a.downlink}" if a.kind in ("diloco", "mixed") else "-",
                outer, f"{steps} x {a.batch}", f"{statistics.fmean(ev):.4f}",
                f"{(max(ev) - min(ev)) / 2:.4f}", "-" if math.isnan(ratio) else f"{ratio:.4f}",
                a.ref or "-", fmt_bytes(row.mean("bytes_up")), fmt_bytes(row.mean("bytes_down")),
                f"{bpt:.2e}" if bpt else "-",
                f"{1 / bpt:,.0f}" if bpt else "-", f"{row.mean('wall_s'):.0f}"])
        if not body:
            continue
        seeds = sorted({s for r in rows.values() for s in r.results})
        first = next(iter(r for r in rows.values() if r.arm.regime == name and r.results))
        before = statistics.fmean(r["eval_loss_before"] for r in first.results.values())
        params = first.results[seeds[0]]["params"] if seeds[0] in first.results else "?"
        base = (f"base {Path(rg.base).name}" if rg.base
                else "pretrained base" if rg.pretrain else "from scratch")
        print(f"\n== regime {name}: tuning {rg.tuning}, {base}, data {rg.data}, "
              f"budget {rg.steps} x {rg.batch} x {rg.seq_len} tokens, inner lr {rg.inner_lr:g}, "
              f"{params} trainable params, held-out loss before {before:.4f}, "
              f"seeds {','.join(map(str, seeds))}")
        print(markdown_table(headers, body) if md else
              table_text(headers, body, right=RIGHT_COLUMNS))


def _rule(a: Arm) -> str:
    return "" if a.outer == "nesterov" else a.outer.removeprefix("nesterov-") + " "


def print_grids(rows: dict[str, Row], md: bool = False) -> None:
    """The outer optimizer grid (H = 50, q4 both ways, mean merge) per regime and k:
    the ratio to dp<k> ± half its range over seeds, outer lr by momentum."""
    lrs, moms = (0.4, 0.7, 1.0), (0.0, 0.5, 0.9)
    for regime, k in itertools.product(("warm", "scratch"), (1, 2, 4, 8)):
        cells = {(r.arm.outer_lr, r.arm.outer_momentum): r
                 for r in _h50_arms(rows, regime, k) if r.arm.wire == r.arm.downlink == "q4"}
        if len(cells) < 4:
            continue
        ref = "single" if k == 1 else f"dp{k}"
        _print_cross(f"outer grid, {regime}, k = {k}, H = 50, q4/q4: ratio to {ref}",
                     "outer lr \\ momentum", lrs, moms, cells, md)


def print_wires(rows: dict[str, Row], md: bool = False) -> None:
    """The wire cross (k = 4, H = 50, outer Nesterov 0.7/0.9) per regime: uplink by
    downlink, the ratio to dp4 ± half its range over seeds."""
    for regime in ("warm", "scratch"):
        cells = {(r.arm.wire, r.arm.downlink): r for r in _h50_arms(rows, regime, 4)
                 if (r.arm.outer_lr, r.arm.outer_momentum) == (0.7, 0.9)}
        if len(cells) >= 4:
            _print_cross(f"wire, {regime}, k = 4, H = 50, outer 0.7/0.9: ratio to dp4",
                         "up \\ down", ("f32", "bf16", "q4"), ("f32", "q4"), cells, md)


def _h50_arms(rows: dict[str, Row], regime: str, k: int) -> list[Row]:
    """The measured DiLoCo arms of a regime at k islands, H = 50, mean merge, no extra
    syncer flags: the arms the cross tables compare."""
    return [r for r in rows.values()
            if r.arm.regime == regime and r.arm.kind == "diloco" and r.arm.k == k
            and r.arm.H == 50 and r.arm.merge == "mean" and not r.arm.syncer_extra
            and r.arm.outer == "nesterov"
            and r.ratios]


def _print_cross(title: str, corner: str, row_keys, col_keys, cells: dict, md: bool) -> None:
    body = [[f"{r:g}" if isinstance(r, float) else r,
             *[_grid_cell(cells.get((r, c))) for c in col_keys]] for r in row_keys]
    headers = [corner, *[f"{c:g}" if isinstance(c, float) else c for c in col_keys]]
    print(f"\n== {title} ± half the range (seeds)")
    print(markdown_table(headers, body) if md else table_text(headers, body))


def _grid_cell(r: Row | None) -> str:
    if r is None:
        return "-"
    v = list(r.ratios.values())
    return f"{statistics.fmean(v):.4f} ± {(max(v) - min(v)) / 2:.4f} ({len(v)})"


def result_lines(rows: dict[str, Row]) -> list[str]:
    out = []
    for row in rows.values():
        for seed, r in sorted(row.results.items()):
            out.append(_result(row.arm, seed, r["eval_loss"], row.ratios.get(seed, math.nan),
                               r["bytes_up"], r["bytes_down"], r["bytes_per_token_ratio"]))
        if len(row.results) > 1:
            ratio = statistics.fmean(row.ratios.values()) if row.ratios else math.nan
            out.append(_result(row.arm, "mean", row.mean("eval_loss"), ratio,
                               row.mean("bytes_up"), row.mean("bytes_down"),
                               row.mean("bytes_per_token_ratio")))
    return out


def _result(arm: Arm, seed, loss, ratio, up, down, bpt) -> str:
    return (f"RESULT arm={arm.key} seed={seed} eval_loss={loss:.5f} ratio={_n(ratio)} "
            f"bytes_up={int(up)} bytes_down={int(down)} bytes_per_token_ratio={_n(bpt)}")


def _n(x: float) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.5g}"


def goal_lines(rows: dict[str, Row]) -> list[str]:
    out = []

    def done(key: str) -> Row | None:
        r = rows.get(key)
        return r if r is not None and r.results else None

    # 1. k=4, q4, H >= 50: eval <= 1.01 x dp4 at >= 500x fewer bytes per token
    for regime in sorted({r.arm.regime for r in rows.values()}):
        cands = [r for r in rows.values() if r.results and r.arm.kind == "diloco"
                 and r.arm.k == 4 and r.arm.wire == "q4" and r.arm.H >= 50 and r.ratios
                 and r.arm.regime == regime and r.arm.ref == "dp4"]
        best = None
        for r in cands:
            ratio = statistics.fmean(r.ratios.values())
            fewer = 1 / r.mean("bytes_per_token_ratio")
            ok = ratio <= 1.01 and fewer >= 500
            if best is None or (ok, -ratio) > (best[0], -best[1]):
                best = (ok, ratio, fewer, r.arm.key)
            out.append(f"RESULT goal=diloco4_q4_H50 arm={r.arm.key} met={'yes' if ok else 'no'} "
                       f"ratio={ratio:.4f} fewer_bytes={fewer:.0f} seeds={len(r.ratios)}")
        if best is not None:
            out.append(f"RESULT goal=diloco4_q4_H50 regime={regime} met="
                       f"{'yes' if best[0] else 'no'} best={best[3]} ratio={best[1]:.4f} "
                       f"fewer_bytes={best[2]:.0f} target_ratio=1.01 target_fewer=500")
    if not any(x.startswith("RESULT goal=diloco4_q4_H50 regime=") for x in out):
        out.append("RESULT goal=diloco4_q4_H50 met=n/a reason=no_arm_ran")
    # 2. q4 within 0.3% of f32: the uplink (q4 pushes against f32 pushes, f32 downlink)
    #    and, reported beside it, the downlink (q4 broadcasts against f32 broadcasts)
    worst: dict[str, tuple] = {}
    for r in rows.values():
        a = r.arm
        if a.kind != "diloco" or a.wire != "q4" or not r.results:
            continue
        pair = None
        if a.name.endswith("-q4"):
            pair = ("up", done(f"{a.regime}:{a.name[:-3]}-f32"))
        elif a.name.endswith("-dq4"):
            pair = ("down", done(f"{a.regime}:{a.name[:-4]}"))
        if pair is None or pair[1] is None:
            continue
        link, f = pair
        seeds = sorted(set(r.results) & set(f.results))
        if not seeds:
            continue
        diffs = [r.results[s]["eval_loss"] / f.results[s]["eval_loss"] - 1 for s in seeds]
        d = statistics.fmean(diffs)
        se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan
        ok = d <= 0.003
        out.append(f"RESULT goal=q4_vs_f32 link={link} q4={a.key} f32={f.arm.key} "
                   f"met={'yes' if ok else 'no'} diff_pct={100 * d:+.3f} "
                   f"se_pct={100 * se:.3f} seeds={len(seeds)}")
        if link not in worst or d > worst[link][0]:
            worst[link] = (d, a.key)
    if "up" in worst:
        d, key = worst["up"]
        out.append(f"RESULT goal=q4_vs_f32 met={'yes' if d <= 0.003 else 'no'} worst={key} "
                   f"diff_pct={100 * d:+.3f} target_pct=0.3")
    else:
        out.append("RESULT goal=q4_vs_f32 met=n/a reason=no_pair_ran")
    if "down" in worst:
        d, key = worst["down"]
        out.append(f"RESULT goal=q4_downlink met={'yes' if d <= 0.003 else 'no'} worst={key} "
                   f"diff_pct={100 * d:+.3f} target_pct=0.3")
    # 3. from scratch: diloco4 <= dp4 < single (the paper's baseline: as many steps,
    #    1/k of the tokens); the default arm, and the best k=4 DiLoCo arm
    dp, single = done("full:dp4"), done("full:single")
    same = done("full:single-same-tokens")
    dls = [r for r in rows.values() if r.results and r.arm.regime == "full"
           and r.arm.kind == "diloco" and r.arm.k == 4]
    if dp and single and dls:
        e_dp, e_single = dp.mean("eval_loss"), single.mean("eval_loss")
        extra = f" single_same_tokens={same.mean('eval_loss'):.4f}" if same else ""
        default = done("full:diloco4-H50-q4")
        best = min(dls, key=lambda r: r.mean("eval_loss"))
        for tag, r in (("default", default), ("best", best)):
            if r is None:
                continue
            e = r.mean("eval_loss")
            ok = e <= e_dp < e_single
            out.append(f"RESULT goal=full_table2 arm={r.arm.key} which={tag} "
                       f"met={'yes' if ok else 'no'} diloco4={e:.4f} dp4={e_dp:.4f} "
                       f"single={e_single:.4f}{extra}")
        e = best.mean("eval_loss")
        out.append(f"RESULT goal=full_table2 met={'yes' if e <= e_dp < e_single else 'no'} "
                   f"best={best.arm.key} diloco4={e:.4f} dp4={e_dp:.4f} single={e_single:.4f}")
    else:
        out.append("RESULT goal=full_table2 met=n/a reason=arms_missing")
    return out


# ---------------------------------------------------------------- outer rules (--rules)

# each regime's goal: ratio to dp<k> at most, bytes per token fewer at least;
# a rule meets the goal when it meets the short and warm cells (scratch: reported)
RULE_TARGETS = {"short": (1.03, 0), "warm": (1.00, 400), "scratch": (1.00, 400),
                "warm2m": (1.00, 400), "real": (1.03, 0)}  # real: k = 2 and 4
REQUIRED = ("short", "warm")


def _rule_rows(rows: dict[str, Row]) -> dict[tuple, Row]:
    """(candidate, cell) -> its row, for the measured arms of the rules table."""
    out = {}
    for r in rows.values():
        cand, cell = candidate_of(r.arm), cell_of(r.arm)
        if cand and cell and r.ratios:
            out[(cand, cell)] = r
    return out


def _cell_name(cell: tuple) -> str:
    return f"{cell[0]}:k{cell[1]}:H{cell[2]}"


def print_rules(rows: dict[str, Row], md: bool, cells: tuple = CELLS) -> None:
    """Candidates by cells: the ratio to dp<k> ± half the range (seeds), "not run" where
    no seed ran; the bytes per token fewer than an all-reduce under each cell."""
    by = _rule_rows(rows)
    if not by:
        return
    cands = list(dict.fromkeys(c for c in CANDIDATES if any(k[0] == c for k in by)))
    body = [[f"{c} ({'/'.join(map(str, CANDIDATES[c]))})",
             *[_grid_cell(by[(c, cell)]) if (c, cell) in by else "not run" for cell in cells]]
            for c in cands]
    fewer = [next((f"{1 / r.mean('bytes_per_token_ratio'):,.0f}x" for (_, cl), r in by.items()
                   if cl == cell), "-") for cell in cells]
    body.append(["bytes fewer than all-reduce", *fewer])
    print("\n== outer rules: ratio to dp<k> ± half the range (seeds), q4 both ways")
    print(markdown_table(["rule (outer/lr/momentum)", *map(_cell_name, cells)], body) if md
          else table_text(["rule", *map(_cell_name, cells)], body))


def rules_goal_lines(rows: dict[str, Row], cells: tuple = CELLS,
                     required: tuple = REQUIRED) -> list[str]:
    """Per candidate and cell: its ratio, spread, bytes and goal; then per candidate
    whether it meets every required cell (no once one fails; n/a while one has no run)."""
    by, out = _rule_rows(rows), []
    for cand in CANDIDATES:
        verdicts = {}
        for cell in cells:
            r = by.get((cand, cell))
            if r is None:
                continue
            v = list(r.ratios.values())
            ratio, fewer = statistics.fmean(v), 1 / r.mean("bytes_per_token_ratio")
            at_most, at_least = RULE_TARGETS[cell[0]]
            verdicts[cell] = ok = ratio <= at_most and fewer >= at_least
            out.append(f"RESULT goal=outer_rule rule={cand} cell={_cell_name(cell)} "
                       f"met={'yes' if ok else 'no'} ratio={ratio:.4f}+-"
                       f"{(max(v) - min(v)) / 2:.4f} fewer_bytes={fewer:.0f} seeds={len(v)} "
                       f"target_ratio={at_most:g} target_fewer={at_least}")
        if not verdicts:
            continue
        missing = [_cell_name(c) for c in cells if c[0] in required and c not in verdicts]
        failed = any(not ok for c, ok in verdicts.items() if c[0] in required)
        met = "no" if failed else "n/a" if missing else "yes"
        out.append(f"RESULT goal=one_rule rule={cand} met={met} "
                   + (f"missing={','.join(missing)} " if missing else "")
                   + f"cells={len(verdicts)}/{len(cells)}")
    return out


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
                      help="the outer-rule candidates (scripts/_diloco_arms.py) in three "
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


def capped(arms: list[Arm], n: int) -> list[Arm]:
    """The arms with at most n steps per island (--max-steps)."""
    if n < 1:
        raise SystemExit(f"--max-steps {n}: give at least 1 step per island, e.g. --max-steps 300")
    return [replace(a, steps=min(a.steps, n),
                    island_steps=tuple(min(x, n) for x in a.island_steps)) for a in arms]


def choose(arms: list[Arm], pick: str) -> list[Arm]:
    """The arms matching a comma list of glob patterns, and their reference arms."""
    pats = [x.strip() for x in pick.split(",") if x.strip()]
    chosen = {a.key for a in arms if any(fnmatch.fnmatchcase(a.key, pt) for pt in pats)}
    chosen |= {f"{a.regime}:{a.ref}" for a in arms if a.key in chosen and a.ref}  # for ratio
    return [a for a in arms if a.key in chosen]


def cached(cache: Path, digest: str) -> dict | None:
    """A cached (arm, seed) result, if there is one for this exact configuration."""
    if not cache.is_file():
        return None
    saved = json.loads(cache.read_text())
    return saved["result"] if saved.get("digest") == digest else None


def report(rows: dict[str, Row], regimes: dict[str, Regime], skipped: list[str],
           md: bool) -> None:
    attach_ratios(rows)
    print_tables(rows, regimes, md)
    print_grids(rows, md)
    print_wires(rows, md)
    for r in rows.values():
        if r.arm.kind != "mixed":
            continue
        for seed, res in sorted(r.results.items()):
            print(f"{r.arm.key} seed {seed}: steps {res['steps']}, wall {res['wall_s']}s, "
                  f"waiting for rounds {res.get('wait_s', '?')}s, "
                  f"tape tokens {res.get('tape_tokens')}, mean share "
                  f"{ {k: round(v, 3) for k, v in res.get('share_mean', {}).items()} }")
    for s in skipped:
        print(f"skipped: {s}")
    print()
    long_mode = any(rg.name in ("warm", "scratch") for rg in regimes.values())
    if "short" in regimes:  # --rules, --quick
        print_rules(rows, md)
        goals = spike_lines(rows) + rules_goal_lines(rows)
    elif "real" in regimes:  # --real
        print_rules(rows, md, REAL_CELLS)
        goals = spike_lines(rows) + rules_goal_lines(rows, REAL_CELLS, ("real",))
    else:
        goals = long_goal_lines(rows) if long_mode else goal_lines(rows)
    for line in result_lines(rows) + goals:
        print(line)


def long_goal_lines(rows: dict[str, Row]) -> list[str]:
    """The long regime's goals: k=4 H=50 q4/q4 <= 1.00 x dp4 at >= 400x
    fewer bytes per token; q4 within 0.3 % of f32; loss falls with k."""
    out = []
    for regime in ("warm", "scratch"):  # every k = 4, H >= 50, q4 both ways arm
        for r in rows.values():
            a = r.arm
            if (a.regime != regime or a.kind != "diloco" or a.k != 4 or a.H < 50
                    or a.wire != "q4" or a.downlink != "q4" or not r.ratios):
                continue
            ratio, fewer = statistics.fmean(r.ratios.values()), 1 / r.mean("bytes_per_token_ratio")
            spread = (max(r.ratios.values()) - min(r.ratios.values())) / 2
            out.append(f"RESULT goal=long_diloco4_vs_dp4 arm={a.key} "
                       f"met={'yes' if ratio <= 1.0 and fewer >= 400 else 'no'} "
                       f"ratio={ratio:.4f}+-{spread:.4f} fewer_bytes={fewer:.0f} "
                       f"seeds={len(r.ratios)}")
    # q4 both ways, and q4 up with f32 down (the default wire), against f32 both ways
    for regime, H, wire in itertools.product(("warm", "scratch"), (50, 100), ("q4/q4", "q4/f32")):
        q4 = rows.get(f"{regime}:diloco4-H{H}-{'q4-dq4' if wire == 'q4/q4' else 'q4'}-nest")
        f32 = rows.get(f"{regime}:diloco4-H{H}-f32-nest")
        seeds = sorted(set(q4.results) & set(f32.results)) if q4 and f32 else []
        if seeds:  # over the seeds both ran
            gap = (statistics.fmean(q4.results[s]["eval_loss"] for s in seeds)
                   / statistics.fmean(f32.results[s]["eval_loss"] for s in seeds) - 1)
            out.append(f"RESULT goal=long_q4_vs_f32 arm={regime}:H{H} wire={wire} "
                       f"met={'yes' if abs(gap) <= 0.003 else 'no'} gap={100 * gap:+.2f}% "
                       f"seeds={len(seeds)}")
    # at a fixed budget per island; warm with Nesterov 0.7/0.9, from scratch with plain
    # averaging (each regime's sweep runs its better rule)
    for regime, suffix in (("warm", "-dq4-nest"), ("scratch", "-dq4")):
        ks = [(k, rows.get(f"{regime}:diloco{k}-H50-q4{suffix}")) for k in (1, 2, 4, 8)]
        losses = [(k, r.mean("eval_loss")) for k, r in ks if r is not None and r.results]
        if len(losses) >= 2:
            falls = all(b[1] < a[1] for a, b in zip(losses, losses[1:]))
            out.append(f"RESULT goal=long_loss_falls_with_k regime={regime} "
                       f"met={'yes' if falls else 'no'} "
                       + " ".join(f"k{k}={v:.4f}" for k, v in losses))
    return out


if __name__ == "__main__":
    sys.exit(main())
