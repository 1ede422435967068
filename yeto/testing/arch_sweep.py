"""Every decoder-only causal LM that both transformers and mlx-lm implement: does the
MLX island compute the same model as the torch island?

The architectures are computed from the installed libraries: the model types in
transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` that are also a module of
``mlx_lm.models``. For each, a tiny random-weight model is written
(`yeto.testing.archs.tiny_model`) and checked with `yeto.interop.parity.check`:
canonical LoRA names, shapes and flat order, then the logits of both islands' models
with the same seeded non-zero adapter on the same token ids.

    python -m yeto.testing.arch_sweep [--only llama,lfm2] [--jobs 2] [--timeout 120]
        [--variants N --seed S] [--markdown PATH] [--lora-targets auto]

(from a checkout: python scripts/arch_sweep.py ...)

``--variants N`` checks, instead of each architecture's preset, N other configs of it
drawn from seed S (`yeto.testing.variants`: layer kinds and their interleaving, widths,
heads, MLP widths, RoPE variants, biases, tied embeddings), each one that transformers
builds and runs.

One row per architecture (per variant): ``ok`` with max |dlogit| and max |logit|, or
why not, with whose problem it is:

  ours/config    the config or weight translation of yeto.mlx (config, checkpoint,
                 load, models: mlx-lm cannot build or load the model)
  mlx-lm         (also) a config mlx-lm cannot represent, refused by yeto.mlx.config
                 or yeto.mlx.load with the field and value (UnsupportedConfig)
  ours/targets   LoRA target selection or canonical names (yeto.targets, yeto.mlx)
  ours/logits    names agree, the base models' logits do not (not yet explained)
  ours/?         the check timed out or crashed its worker
  mlx-lm         a bug or gap in mlx-lm, or another architecture under the same
                 model type (the reason says which, and how it was checked)
  transformers   transformers cannot build a tiny random model of it

A failure whose cause was checked to be outside yeto is listed in `KNOWN` with that
cause; it is used only while the check fails, so a fixed upstream bug shows as ok.
Then a count by status, and ``RESULT ok=N of M``.

A row is ``ok`` when max |dlogit| <= 1e-4 x max |logit| (`yeto.interop.parity.REL_TOL`).
Each check runs in a worker subprocess with a time limit, so one hang or crash does not stop the
sweep (the worker is replaced).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # holds yeto: the workers' cwd

# Per-architecture overrides of the tiny config beyond yeto.testing.archs.TINY_OVERRIDES,
# for architectures its settings cannot make a valid tiny model of; each says why.
OVERRIDES: dict[str, dict] = {}

# Failures verified to be outside yeto, by architecture: (owner, the stage it fails at,
# reason). Used only when the check fails at that stage, so a fixed upstream bug shows
# up as ok and another failure of a variant is not taken for it.
KNOWN: dict[str, tuple[str, str, str]] = {
    "olmo": ("mlx-lm", "mlx-import",
             "mlx-lm's olmo.py calls sys.exit unless the ai2-olmo package (hf_olmo) is "
             "installed; it reads the original OLMo checkpoint layout"),
    "bitnet": ("mlx-lm", "mlx-load",
               "mlx-lm's bitnet.py loads only packed ternary checkpoints (weight_scale per "
               "BitLinear); transformers writes unpacked BitNet weights, and LoRA on packed "
               "layers is not supported anyway"),
    "minimax": ("mlx-lm", "mlx-load",
                "mlx-lm's minimax.py is MiniMax-M2 (full attention, QK-norm, rotary_dim); "
                "transformers' minimax is MiniMax-Text-01 (lightning linear-attention layers), "
                "another architecture under the same model type"),
    "bailing_hybrid": ("mlx-lm", "mlx-load",
                       "mlx-lm's bailing_hybrid.py has lightning linear attention (g_proj + "
                       "GroupRMSNorm, group_norm_size); transformers' bailing_hybrid has gated "
                       "delta-rule attention (BailingHybridDeltaAttention): another architecture "
                       "under the same model type"),
    "gemma3n": ("transformers", "tiny",
                "Gemma3nForConditionalGeneration needs timm and pillow for its vision tower "
                "(not installed), so no tiny model is written"),
}

# Model types whose mlx-lm module is not the architecture (or checkpoint format) that
# transformers implements under the same name (the reasons are in KNOWN). Their rows
# are reported but not counted in RESULT, which is over the architectures both
# libraries implement; the line before it gives the count over every row.
NOT_SHARED = frozenset({"olmo", "bitnet", "minimax", "bailing_hybrid"})

STAGE_OWNER = {
    "tiny": "transformers",
    "mlx-import": "mlx-lm",
    "torch-build": "transformers",
    "torch-targets": "ours/targets",
    "mlx-load": "ours/config",
    "mlx-targets": "ours/targets",
    "names": "ours/targets",
    "forward": "ours/logits",
    "logits": "ours/logits",
    "adapter": "ours/targets",
}


def architectures() -> list[str]:
    """Model types with a transformers causal-LM class and an mlx-lm module."""
    import pkgutil

    import mlx_lm.models
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    mods = {m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__)}
    return sorted(a for a in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if a in mods)


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {p: version(p) for p in ("transformers", "mlx", "mlx-lm", "torch", "peft")}


# ---- one architecture (in a worker) -------------------------------------------------
def check_arch(arch: str, targets: str, r: int, variant: int | None = None,
               seed: int = 0) -> dict:
    from yeto.interop import parity
    from yeto.testing.archs import tiny_model

    t0 = time.perf_counter()
    row: dict = {"arch": arch, "variant": variant}
    try:
        overrides = dict(OVERRIDES.get(arch, {}))
        if variant is not None:
            from yeto.testing.variants import valid_variant

            try:
                drawn, row["config"], _ = valid_variant(arch, seed, variant)
            except ValueError as e:
                raise parity.ParityError("tiny", str(e)) from e
            overrides.update(drawn)
        with tempfile.TemporaryDirectory(prefix=f"sweep-{arch}-") as d:
            tiny_model(arch, d, overrides=overrides or None)
            rep = parity.check(d, r=r, alpha=2.0 * r, targets=targets)
        row.update(n=rep.n_tensors, dlogit=rep.max_dlogit, logit=rep.max_logit,
                   effect=rep.adapter_effect, base_dlogit=rep.base_dlogit)
        if rep.notes:
            row["notes"] = rep.notes
        if not rep.names_ok:
            row.update(stage="names", error=rep.first_mismatch or "layout fingerprints differ")
    except parity.ParityError as e:
        row.update(stage=e.stage, error=str(e.args[0]), where=_where(e.__cause__ or e))
    except BaseException as e:  # noqa: BLE001 - anything else is a row, not a dead worker
        if isinstance(e, KeyboardInterrupt):
            raise
        row.update(stage="forward", error=f"{type(e).__name__}: {e}", where=_where(e))
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def _where(e: BaseException) -> str:
    """file:line of the innermost frame of an exception (for --verbose)."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    return "; ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-3:])


def worker(targets: str, r: int) -> None:
    """Read architecture names from stdin, write one JSON row per line to stdout."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    out = sys.stdout
    sys.stdout = sys.stderr  # anything a library prints stays off the protocol
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        if line.strip():
            task = json.loads(line)
            out.write(json.dumps(check_arch(task["arch"], targets, r, task.get("variant"),
                                            task.get("seed", 0))) + "\n")
            out.flush()


# ---- the sweep --------------------------------------------------------------------
class Worker:
    def __init__(self, targets: str, r: int):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "yeto.testing.arch_sweep", "--worker", "--lora-targets",
             targets, "--lora-r", str(r)], cwd=ROOT, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = False

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def ask(self, task: dict, timeout: float) -> dict:
        arch = {"arch": task["arch"], "variant": task.get("variant")}
        deadline = time.monotonic() + timeout
        try:
            if not self.ready:  # the first answer waits for the imports too
                line = self.lines.get(timeout=max(60.0, timeout))
                if line is None:
                    return {**arch, "stage": "crash", "error": "worker did not start"}
                self.ready = True
                deadline = time.monotonic() + timeout
            self.proc.stdin.write(json.dumps(task) + "\n")
            self.proc.stdin.flush()
            line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            return {**arch, "stage": "timeout", "error": f"no answer in {timeout:.0f} s"}
        except (BrokenPipeError, OSError) as e:
            return {**arch, "stage": "crash", "error": f"worker gone: {e}"}
        if line is None:
            return {**arch, "stage": "crash",
                    "error": f"worker died (exit {self.proc.wait()})"}
        return json.loads(line)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_sweep(tasks: list[dict], jobs: int, timeout: float, targets: str, r: int,
              on_row=None) -> list[dict]:
    """One row per task ({"arch", "variant", "seed"}), in the order of ``tasks``."""
    todo: queue.Queue = queue.Queue()
    for i, t in enumerate(tasks):
        todo.put((i, t))
    rows: dict[int, dict] = {}
    lock = threading.Lock()

    def lane() -> None:
        w = Worker(targets, r)
        try:
            while True:
                try:
                    i, task = todo.get_nowait()
                except queue.Empty:
                    return
                row = w.ask(task, timeout)
                if row.get("stage") in ("timeout", "crash") or not w.alive():
                    w.stop()
                    w = Worker(targets, r)
                with lock:
                    rows[i] = classify(row)
                    if on_row:
                        on_row(rows[i])
        finally:
            w.stop()

    threads = [threading.Thread(target=lane) for _ in range(max(1, min(jobs, len(tasks))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [rows[i] for i in range(len(tasks))]


def classify(row: dict) -> dict:
    """Fill ``status`` (ok / the owner of the failure) and ``reason``."""
    arch, stage = row["arch"], row.get("stage")
    if stage is None:
        from yeto.interop.parity import REL_TOL as bound

        rel = row["dlogit"] / max(row["logit"], 1e-30)
        if rel <= bound:
            row.update(status="ok", reason="")
            return row
        stage = "logits"
        row["error"] = (f"max |dlogit| {row['dlogit']:.3g} > {bound:g} x max |logit| "
                        f"{row['logit']:.3g} (without the adapter: {row['base_dlogit']:.3g})"
                        + "".join(f"; {n}" for n in row.get("notes", [])))
        base_rel = (row.get("base_dlogit") or 0.0) / max(row["logit"], 1e-30)
        if base_rel <= bound:
            stage = "adapter"  # the base models agree: how an adapted layer is applied
    owner = STAGE_OWNER.get(stage, "ours/logits" if stage in ("forward", "logits") else "?")
    reason = f"{stage}: {row.get('error', '')}"
    known = KNOWN.get(arch)
    if "UnsupportedConfig" in row.get("error", ""):
        owner = "mlx-lm"  # refused by yeto.mlx: the message names field and value
    elif known is not None and (known[1] == stage or {known[1], stage} <= {"logits", "adapter"}):
        owner, _, why = known
        reason = f"{why} [{reason}]"
        if arch in NOT_SHARED:
            row["not_shared"] = True
    elif stage in ("timeout", "crash"):
        owner = "ours/?"
    row.update(status=owner, reason=" ".join(reason.split())[:300])
    return row


def label(row: dict) -> str:
    """``arch`` for a preset, ``arch#v`` for variant v."""
    return row["arch"] if row.get("variant") is None else f"{row['arch']}#{row['variant']}"


def fmt_row(row: dict) -> str:
    config = f"  [{row['config']}]" if row.get("config") else ""
    if row["status"] == "ok":
        return (f"{label(row):<20} ok            n={row['n']:<4} max|dlogit| "
                f"{row['dlogit']:.2e}  max|logit| {row['logit']:.2f}{config}")
    return f"{label(row):<20} {row['status']:<13} {row['reason']}{config}"


def summary(rows: list[dict]) -> str:
    """Rows by status, e.g. ``ok 73, mlx-lm 7, transformers 1``."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    parts = [f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: (kv[0] != "ok", kv[0]))]
    return "by status: " + ", ".join(parts)


def result_lines(rows: list[dict]) -> list[str]:
    """The count over every row, then ``RESULT ok=N of M`` over the rows of
    architectures both libraries implement (rows failing for a `NOT_SHARED` reason
    left out, and named)."""
    ok = sum(r["status"] == "ok" for r in rows)
    out = [r for r in rows if r.get("not_shared")]
    lines = [f"over every row: ok={ok} of {len(rows)}"]
    if out:
        names = ", ".join(sorted({r["arch"] for r in out}))
        lines.append(f"not counted: {len(out)} rows of {names} (mlx-lm's module of that name "
                     "is another architecture or checkpoint format; see KNOWN)")
    return lines + [f"RESULT ok={ok} of {len(rows) - len(out)}"]


def activation_rows() -> list[str]:
    """`yeto.mlx.activations.ACTIVATION_SITES` as markdown rows: per model type, the
    mlx-lm class, the activation it calls, what the preset config names, and whether
    the MLX island swaps it."""
    import importlib
    import inspect

    from yeto.mlx.activations import (
        ACTIVATION_SITES,
        ACTIVATIONS,
        CALLED,
        called,
        config_activation,
    )
    from yeto.testing.archs import tiny_config

    rows = ["| model type | mlx-lm class | mlx-lm calls | config field = preset value | "
            "MLX island computes |", "|---|---|---|---|---|"]
    for kind, (field, classes) in sorted(ACTIVATION_SITES.items()):
        module = importlib.import_module(f"mlx_lm.models.{kind}")
        found = {n: c for m in (module, *[v for v in vars(module).values()
                                          if inspect.ismodule(v) and "mlx_lm" in v.__name__])
                 for n, c in vars(m).items() if inspect.isclass(c)}
        value = config_activation(tiny_config(kind).to_dict(), field)
        for name in classes:
            call = called(found[name])
            want = ACTIVATIONS.get(value, "?")
            done = "as called" if CALLED[call] == want else f"**{want}** (swapped)"
            rows.append(f"| {kind} | {name} | {call} | {field} = {value} | {done} |")
    return rows


def markdown(rows: list[dict], result: str, cmd: str) -> str:
    v = versions()
    lines = ["## Architecture sweep: torch island vs MLX island", "",
             "Tiny random-weight models, LoRA on every target `auto` picks, the same seeded "
             "non-zero adapter in both islands, the same token ids; `ok` when max |dlogit| "
             "≤ 1e-4 × max |logit|. Status other "
             "than `ok` says whose the failure is: `ours/...` (yeto), `mlx-lm`, "
             "`transformers`.", "",
             "Versions: " + ", ".join(f"{k} {x}" for k, x in v.items()) + f". Command: `{cmd}`.",
             "", "| architecture | variant | status | tensors | max abs dlogit | max abs logit "
             "| reason |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = r["status"] == "ok"
        reason = r.get("reason", "").replace("|", "\\|")
        variant = "preset" if r.get("variant") is None else f"{r['variant']}: {r.get('config', '')}"
        lines.append(f"| {r['arch']} | {variant} | {r['status']} | "
                     f"{r.get('n', '') if ok else ''} | "
                     f"{format(r['dlogit'], '.2e') if ok else ''} | "
                     f"{format(r['logit'], '.2f') if ok else ''} | {reason} |")
    lines += ["", summary(rows), "", *[f"`{x}`  " for x in result.splitlines()], "",
              "### Activations (`yeto.mlx.activations.ACTIVATION_SITES`)", "",
              "Where mlx-lm's module calls one activation hard-coded and transformers builds it "
              "from the config; swapped on the built model when they differ.", "",
              *activation_rows(), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m yeto.testing.arch_sweep",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=None, help="comma list of model types to check")
    p.add_argument("--jobs", type=int, default=max(1, min(4, (os.cpu_count() or 2) // 2)),
                   help="worker processes")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per check")
    p.add_argument("--variants", type=int, default=0,
                   help="check N configs drawn per architecture instead of its preset")
    p.add_argument("--seed", type=int, default=0, help="seed the --variants draws come from")
    p.add_argument("--lora-targets", default="auto")
    p.add_argument("--lora-r", type=int, default=4)
    p.add_argument("--markdown", default=None, help="write the table as markdown to PATH")
    p.add_argument("--json", default=None, help="write the rows as JSON to PATH")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.lora_targets, args.lora_r)
        return 0
    archs = architectures()
    if args.only:
        wanted = [a.strip() for a in args.only.split(",") if a.strip()]
        unknown = [a for a in wanted if a not in archs]
        if unknown:
            print(f"not in the intersection: {', '.join(unknown)}", file=sys.stderr)
            return 2
        archs = wanted
    print(f"{len(archs)} architectures in transformers and mlx-lm; "
          + ", ".join(f"{k} {x}" for k, x in versions().items()), flush=True)
    variants = range(args.variants) if args.variants > 0 else [None]
    tasks = [{"arch": a, "variant": v, "seed": args.seed} for a in archs for v in variants]
    rows = run_sweep(tasks, args.jobs, args.timeout, args.lora_targets, args.lora_r,
                     on_row=lambda r: print(fmt_row(r), flush=True))
    print("\n" + "\n".join(fmt_row(r) for r in rows))
    print(summary(rows))
    result = "\n".join(result_lines(rows))
    print(result)
    cmd = " ".join(["python -m yeto.testing.arch_sweep",
                    *(argv if argv is not None else sys.argv[1:])])
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows, result, cmd.strip()))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
