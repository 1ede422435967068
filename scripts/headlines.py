"""Re-measure the figures the README and the top of BENCHMARKS.md quote, and print them
as one RESULT line (and, with --markdown, the current-results table BENCHMARKS.md opens
with). Each figure is re-run, not carried:

  sft_demo     `yeto demo` (two torch islands, the default rule): held-out loss
               before and after
  rl_<topo>    `yeto demo --rl` for each topology (observer nodes, the MLX trainer,
               nodes kept current by the trainer), seeds 0, 1, 2: held-out reward
               before and after, each seed and the mean change
  parity       torch and MLX islands on each tiny preset (llama, qwen2, qwen3): names
               agree and max |dlogit| with a random adapter (`yeto.interop.parity`)
  diloco_dp    `scripts/compare_diloco.py --quick`: the default rule's short LoRA cell
               against data-parallel on the same tokens, 3 seeds (mean ratio)
  syncer_bpp   `scripts/bench_memory.py`: the syncer's bytes per parameter

    python scripts/headlines.py                    # everything (about 45 min on 2 cores)
    python scripts/headlines.py --parts rl,parity  # some of it
    python scripts/headlines.py --resume           # reuse this commit's finished pieces

Each piece runs in its own folder under --out (default runs/headlines/); a finished
piece records the commit it ran at, and --resume reuses only pieces of the current
commit (with a clean tree), so a stopped run picks up where it stopped without carrying
figures across changes. The last line is

    RESULT commit=... sft_loss=A->B rl_observer=... rl_mlx=... rl_direct=... parity=...
           diloco_dp=... syncer_bpp=...
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SEEDS = (0, 1, 2)
# topology -> extra `yeto demo --rl` flags
RL_TOPOLOGIES = {"observer": [], "mlx": ["--trainer", "mlx"], "direct": ["--nodes", "direct"]}
PRESETS = ("llama", "qwen2", "qwen3")
PARTS = ("sft", "rl", "parity", "diloco", "bpp")


def commit() -> str:
    """The commit measured, with '+dirty' when the tree has uncommitted changes."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return head + ("+dirty" if dirty else "")


class Piece:
    """One measured piece: its folder, the command that makes it and its result file."""

    def __init__(self, out: Path, name: str, cmd: list[str], result: str = "summary.json"):
        self.dir, self.name, self.cmd = out / name, name, cmd
        self.result = self.dir / result
        self.stamp = self.dir / "headline.json"

    def cached(self, at: str) -> bool:
        if "+dirty" in at or not (self.stamp.is_file() and self.result.is_file()):
            return False
        return json.loads(self.stamp.read_text()).get("commit") == at

    def run(self, at: str, resume: bool, timeout: float) -> dict:
        if not (resume and self.cached(at)):
            self.dir.mkdir(parents=True, exist_ok=True)
            t0 = time.monotonic()
            print(f"[{self.name}] {' '.join(map(str, self.cmd))}", flush=True)
            with open(self.dir.with_suffix(".log"), "w") as log:
                code = subprocess.run(self.cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=timeout).returncode
            if code != 0:
                raise RuntimeError(f"{self.name} failed ({code}); see "
                                   f"{self.dir.with_suffix('.log')}")
            self.stamp.write_text(json.dumps(dict(commit=at, seconds=time.monotonic() - t0)))
        else:
            print(f"[{self.name}] reused (commit {at})", flush=True)
        return json.loads(self.result.read_text()) if self.result.suffix == ".json" else \
            dict(text=self.result.read_text())


def sft(out: Path) -> Piece:
    return Piece(out, "sft-demo", [PY, "-m", "yeto", "demo", "--out", str(out / "sft-demo"),
                                   "--display", "plain", "--no-dashboard"])


def rl(out: Path, topo: str, seed: int) -> Piece:
    name = f"rl-{topo}-s{seed}"
    return Piece(out, name, [PY, "-m", "yeto", "demo", "--rl", "--seed", str(seed),
                             "--out", str(out / name), *RL_TOPOLOGIES[topo]])


def parity(out: Path) -> Piece:
    return Piece(out, "parity", [PY, str(Path(__file__)), "--parity-only",
                                 "--out", str(out / "parity")], result="parity.json")


def diloco(out: Path) -> Piece:
    return Piece(out, "diloco-quick", [PY, str(ROOT / "scripts" / "compare_diloco.py"),
                                       "--quick", "--out", str(out / "diloco-quick" / "cache"),
                                       "--jobs", "1"], result="../diloco-quick.log")


def bpp(out: Path) -> Piece:
    return Piece(out, "bench-memory", [PY, str(ROOT / "scripts" / "bench_memory.py")],
                 result="../bench-memory.log")


def parity_only(out: Path) -> int:
    """Run the parity check on each preset (a process of its own: MLX and torch)."""
    from yeto.interop import parity as check
    from yeto.testing.tiny import make_tiny_model

    rows = []
    for arch in PRESETS:
        model = make_tiny_model(out / arch, arch=arch)
        rep = check.check(model)
        rows.append(dict(arch=arch, names_ok=rep.names_ok, logits_ok=bool(rep.logits_ok()),
                         tensors=rep.n_tensors, max_dlogit=rep.max_dlogit,
                         max_logit=rep.max_logit))
    (out / "parity.json").write_text(json.dumps(rows, indent=2))
    return 0 if all(r["names_ok"] and r["logits_ok"] for r in rows) else 1


def last_result(text: str, pattern: str) -> dict[str, str]:
    """The key=value pairs of the last RESULT line matching `pattern`."""
    lines = [x for x in text.splitlines() if x.startswith("RESULT") and re.search(pattern, x)]
    if not lines:
        raise RuntimeError(f"no RESULT line matching {pattern!r}")
    return dict(kv.split("=", 1) for kv in lines[-1].split()[1:] if "=" in kv)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "headlines")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--resume", action="store_true",
                   help="reuse pieces finished at this commit (clean tree only)")
    p.add_argument("--markdown", action="store_true",
                   help="also print the current-results table for BENCHMARKS.md")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per piece")
    p.add_argument("--parity-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out = args.out.resolve()
    if args.parity_only:
        out.mkdir(parents=True, exist_ok=True)
        return parity_only(out)
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    if parts - set(PARTS):
        p.error(f"unknown parts {sorted(parts - set(PARTS))}; use {', '.join(PARTS)}")
    at, result, rows = commit(), {}, []
    if "sft" in parts:
        s = sft(out).run(at, args.resume, args.timeout)
        result["sft_loss"] = f"{s['eval_loss_before']:.4f}->{s['eval_loss_after']:.4f}"
        rows.append(("`yeto demo` held-out loss (2 torch islands, 200 steps)",
                     f"{s['eval_loss_before']:.4f} → {s['eval_loss_after']:.4f}",
                     "falls"))
    if "rl" in parts:
        for topo in RL_TOPOLOGIES:
            runs = [rl(out, topo, seed).run(at, args.resume, args.timeout) for seed in SEEDS]
            changes = [r["reward_after"] - r["reward_before"] for r in runs]
            mean = statistics.mean(changes)
            per_seed = ", ".join(f"s{seed} {r['reward_before']:.3f}→{r['reward_after']:.3f}"
                                 for seed, r in zip(SEEDS, runs))
            rules = {r["outer_rule"]["outer"] for r in runs if r.get("outer_rule")}
            result[f"rl_{topo}"] = f"{mean:+.3f}"
            rows.append((f"`yeto demo --rl {' '.join(RL_TOPOLOGIES[topo])}`".replace(" `", "`")
                         + f" held-out reward change, mean of seeds 0–2 ({per_seed}; rule "
                         f"{'/'.join(sorted(rules))})", f"{mean:+.3f}", "≥ +0.05"))
    if "parity" in parts:
        prs = parity(out).run(at, args.resume, args.timeout)
        worst = max(r["max_dlogit"] for r in prs)
        ok = all(r["names_ok"] and r["logits_ok"] for r in prs)
        result["parity"] = f"{'ok' if ok else 'FAILED'}:{worst:.2e}"
        rows.append((f"torch + MLX parity on the presets ({', '.join(PRESETS)}): names, "
                     f"max |dlogit|", f"{'OK' if ok else 'FAILED'}, {worst:.2e}", "OK"))
    if "diloco" in parts:
        text = diloco(out).run(at, args.resume, args.timeout)["text"]
        goal = last_result(text, r"goal=outer_rule .*cell=short")
        result["diloco_dp"] = goal["ratio"]
        rows.append(("DiLoCo k = 4, H = 50, q4 both ways ÷ data-parallel, short LoRA, "
                     "3 seeds (`compare_diloco.py --quick`)",
                     f"{goal['ratio']} ({goal.get('fewer_bytes', '?')}× fewer bytes)",
                     "≤ 1.03"))
    if "bpp" in parts:
        text = bpp(out).run(at, args.resume, args.timeout)["text"]
        b = last_result(text, r"syncer_bytes_per_param=")
        result["syncer_bpp"] = b["syncer_bytes_per_param"]
        rows.append(("syncer bytes per parameter (`bench_memory.py`)",
                     b["syncer_bytes_per_param"], "≤ 10 (≤ 14 with momentum)"))
    if args.markdown:
        print(f"\n| figure (commit {at}, {time.strftime('%Y-%m-%d')}) | measured | goal |")
        print("|---|---|---|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
    print("RESULT commit=" + at + "".join(f" {k}={v}" for k, v in result.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
