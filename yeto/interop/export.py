"""`yeto export` and `yeto convert`: a run's adapter for peft or mlx-lm, exactly.

    yeto export --state-dir runs/demo/syncer --out runs/demo/mlx --format mlx
    yeto convert runs/demo/adapter runs/demo/mlx --to mlx [--verify]
    yeto convert runs/demo/mlx runs/demo/peft --to peft --base-model runs/demo/model

`export` takes the syncer's final adapter (``<state-dir>/final/``), or, for a run
that has not finished, the last merged weights in ``<state-dir>/state.safetensors``
(with the adapter config the islands sent). `convert` converts an adapter dir
either way. The conversion itself is `yeto.interop.adapters` (lora_a = Aᵀ, lora_b = Bᵀ,
scale = lora_alpha / r; numbers copied bit for bit); mlx-lm adapts the *last*
``num_layers`` blocks with one list of module keys, and the written config says
exactly which. What mlx-lm cannot express exactly (rsLoRA, DoRA, per-module
rank/alpha patterns, biases, saved modules, adapted blocks that are not the last
N) is refused with the reason. ``--verify`` loads both sides with the real loaders
(``peft.PeftModel.from_pretrained``, ``mlx_lm.load(..., adapter_path=...)``) and
compares their logits on a fixed batch.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from yeto.interop.adapters import (
    MLX_CONFIG,
    MLX_WEIGHTS,
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    AdapterConversionError,
    mlx_to_peft,
    peft_to_mlx,
    run_adapter_tensors,
    save_peft_adapter,
)
from yeto.io import atomic_save, atomic_write

FORMATS = ("peft", "mlx")


class ExportError(RuntimeError):
    """An export or conversion that cannot be done (the message says why)."""


# ---- what a dir holds -----------------------------------------------------------------
def adapter_format(path: Path) -> str:
    """"peft" or "mlx" for an adapter dir, else ExportError."""
    path = Path(path)
    if (path / PEFT_WEIGHTS).is_file() and (path / PEFT_CONFIG).is_file():
        return "peft"
    if (path / MLX_WEIGHTS).is_file() and (path / MLX_CONFIG).is_file():
        return "mlx"
    if (path / "model.safetensors").is_file():
        raise ExportError(f"{path} holds full model weights (model.safetensors), not a LoRA "
                          "adapter: it already loads with transformers' from_pretrained (copy "
                          "the tokenizer files from the base model beside it)")
    raise ExportError(f"{path} is not an adapter dir: expected {PEFT_WEIGHTS} + {PEFT_CONFIG} "
                      f"(peft) or {MLX_WEIGHTS} + {MLX_CONFIG} (mlx-lm)")


def base_model_of(adapter_dir: Path) -> str | None:
    """The base model an adapter dir names (peft's base_model_name_or_path, mlx-lm's
    model, or the peft config kept inside an mlx-lm config)."""
    cfg_path = Path(adapter_dir) / PEFT_CONFIG  # the same file name for both formats
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    for value in (cfg.get("base_model_name_or_path"), cfg.get("model"),
                  (cfg.get("peft_config") or {}).get("base_model_name_or_path")):
        if value:
            return str(value)
    return None


# ---- export -----------------------------------------------------------------------------
def export(state_dir: Path, out: Path, fmt: str, base_model: str | None = None,
           allow_unfinished: bool = True) -> tuple[Path, str]:
    """Write the run's adapter in ``fmt``; returns (out, a line saying what was exported)."""
    state_dir = Path(state_dir)
    final = state_dir / "final"
    if final.is_dir() and any(final.iterdir()):
        what = f"the final adapter of {state_dir}"
        return _write(final, Path(out), fmt, base_model), what
    if not (state_dir / "state.safetensors").is_file():
        raise ExportError(f"{state_dir} holds neither final/ nor state.safetensors: pass the "
                          "syncer's --state-dir (e.g. runs/demo/syncer)")
    if not allow_unfinished:
        raise ExportError(f"{state_dir} has no final/ (the run has not finished)")
    with tempfile.TemporaryDirectory() as tmp:
        version = _adapter_from_state(state_dir, Path(tmp))
        what = (f"the last merged weights of {state_dir} (version {version}; the run has not "
                "finished, so there is no final/ yet)")
        return _write(Path(tmp), Path(out), fmt, base_model), what


def _adapter_from_state(state_dir: Path, out: Path) -> int:
    from syncer.state import StateError, load
    from yeto.layout import Layout, TensorSpec

    try:
        theta, _, _, meta = load(state_dir)
    except StateError as e:
        raise ExportError(str(e)) from None
    if meta.get("weights_file") != PEFT_WEIGHTS or PEFT_CONFIG not in meta.get("export_files",
                                                                                {}):
        raise ExportError(f"{state_dir}: the run's weights are {meta.get('weights_file')!r} "
                          "without a peft adapter config: only LoRA runs export as adapters")
    layout = Layout([TensorSpec(n, tuple(s), d) for n, s, d in meta["layout"]])
    # the same tensors the syncer's final/ gets (frozen-A runs: lora_A rebuilt from the seed)
    tensors = run_adapter_tensors(layout.unflatten(theta), meta["export_files"])
    save_peft_adapter(out, tensors, meta["export_files"][PEFT_CONFIG])
    return int(meta.get("version", 0))


def _write(src: Path, out: Path, fmt: str, base_model: str | None) -> Path:
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}: choose peft or mlx")
    kind = adapter_format(src)
    if kind == "mlx":
        raise ExportError(f"{src} is an mlx-lm adapter; `yeto convert` converts it")
    if fmt == "mlx":
        return peft_to_mlx(src, out, base_model=base_model)
    out.mkdir(parents=True, exist_ok=True)
    atomic_save(out / PEFT_WEIGHTS, lambda tmp: shutil.copyfile(src / PEFT_WEIGHTS, tmp))
    cfg = json.loads((src / PEFT_CONFIG).read_text())
    if base_model is not None:
        cfg["base_model_name_or_path"] = str(base_model)
    atomic_write(out / PEFT_CONFIG, json.dumps(cfg, indent=2, sort_keys=True))
    return out


# ---- convert ----------------------------------------------------------------------------
def convert(src: Path, dest: Path, to: str, base_model: str | None = None) -> Path:
    src, dest = Path(src), Path(dest)
    if to not in FORMATS:
        raise ExportError(f"--to {to!r}: choose peft or mlx")
    kind = adapter_format(src)
    if src.resolve() == dest.resolve():
        raise ExportError("SRC and DEST are the same dir: write the conversion somewhere else")
    if kind == to:
        raise ExportError(f"{src} is already a {to} adapter (nothing to convert)")
    if to == "mlx":
        return peft_to_mlx(src, dest, base_model=base_model)
    base = base_model or base_model_of(src)
    if not base:
        raise ExportError(f"{src} does not name its base model: pass --base-model PATH (the "
                          "Hugging Face model dir the adapter was trained on)")
    return mlx_to_peft(src, dest, base_model=base)


# ---- verify -----------------------------------------------------------------------------
def verify(peft_dir: Path, mlx_dir: Path, base_model: str, seq_len: int = 24,
           batch: int = 2, seed: int = 0) -> float:
    """Max |Δ| between the logits of the base model with the peft adapter
    (``peft.PeftModel.from_pretrained``) and with the mlx-lm adapter
    (``mlx_lm.load(base, adapter_path=...)``), both in float32, on a fixed batch."""
    import mlx.core as mx
    import mlx_lm
    import numpy as np
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_model), dtype=torch.float32)
    vocab = model.config.vocab_size
    ids = np.random.default_rng(seed).integers(3, min(vocab, 30000), (batch, seq_len))
    peft_model = PeftModel.from_pretrained(model, str(peft_dir)).eval()
    with torch.no_grad():
        want = peft_model(input_ids=torch.from_numpy(ids)).logits.float().numpy()
    mlx_model, _ = mlx_lm.load(str(base_model), adapter_path=str(mlx_dir))
    mlx_model.set_dtype(mx.float32)
    got = np.asarray(mlx_model(mx.array(ids)).astype(mx.float32))
    return float(np.abs(got - want).max())


# ---- CLI ----------------------------------------------------------------------------------
def build_export_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="yeto export", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Write a run's adapter (the syncer's final/, or its last merged weights "
                    "when the run has not finished) as a peft or an mlx-lm adapter.",
        epilog="Examples:\n  yeto export --state-dir runs/demo/syncer --out runs/demo/mlx "
               "--format mlx\n  python -m mlx_lm generate --model runs/demo/model "
               "--adapter-path runs/demo/mlx --prompt ...")
    p.add_argument("--state-dir", type=Path, required=True, help="the syncer's --state-dir")
    p.add_argument("--out", type=Path, required=True, help="the adapter dir to write")
    p.add_argument("--format", choices=FORMATS, default="peft",
                   help="peft (PeftModel.from_pretrained) or mlx (mlx_lm.load adapter_path)")
    p.add_argument("--base-model", default=None,
                   help="the local base model dir (default: the one the adapter names); mlx-lm "
                        "needs its block count")
    p.add_argument("--final-only", action="store_true",
                   help="refuse a run that has not finished instead of exporting its last "
                        "merged weights")
    p.add_argument("--verify", action="store_true",
                   help="with --format mlx: load both adapters with the real loaders and "
                        "compare logits (needs torch, peft, mlx, mlx-lm)")
    p.add_argument("--verify-tol", type=float, default=1e-4,
                   help="largest accepted max |Δlogit| for --verify")
    return p


def build_convert_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="yeto convert", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Convert a LoRA adapter between peft's layout and mlx-lm's, exactly "
                    "(refusing what cannot be converted exactly).",
        epilog="Examples:\n  yeto convert runs/demo/adapter runs/demo/mlx --to mlx\n"
               "  yeto convert adapters/ peft-adapter/ --to peft --base-model runs/demo/model")
    p.add_argument("src", type=Path, help="an adapter dir (peft or mlx-lm; detected)")
    p.add_argument("dest", type=Path, help="the dir to write")
    p.add_argument("--to", choices=FORMATS, required=True, help="the format to write")
    p.add_argument("--base-model", default=None,
                   help="the local base model dir (default: the one the adapter names)")
    p.add_argument("--verify", action="store_true",
                   help="load both adapters with the real loaders and compare logits")
    p.add_argument("--verify-tol", type=float, default=1e-4,
                   help="largest accepted max |Δlogit| for --verify")
    return p


def _run_verify(peft_dir: Path, mlx_dir: Path, base: str | None, tol: float) -> int:
    if not base:
        print("error: --verify needs the base model: pass --base-model PATH", file=sys.stderr)
        return 2
    diff = verify(peft_dir, mlx_dir, base)
    ok = diff <= tol
    print(f"verify: max |logits(peft) - logits(mlx-lm)| = {diff:.3g} "
          f"({'ok' if ok else 'FAILED'}, tolerance {tol:g})")
    return 0 if ok else 1


def main_export(argv=None) -> int:
    args = build_export_parser().parse_args(argv)
    try:
        out, what = export(args.state_dir, args.out, args.format, args.base_model,
                           allow_unfinished=not args.final_only)
    except (ExportError, AdapterConversionError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {what} to {out} ({args.format})")
    if args.verify:
        if args.format != "mlx":
            print("error: --verify compares a peft and an mlx-lm adapter: use --format mlx",
                  file=sys.stderr)
            return 2
        final = args.state_dir / "final"
        if not final.is_dir():
            print("error: --verify needs the run's final/ adapter", file=sys.stderr)
            return 2
        return _run_verify(final, out, args.base_model or base_model_of(final), args.verify_tol)
    return 0


def main_convert(argv=None) -> int:
    args = build_convert_parser().parse_args(argv)
    try:
        out = convert(args.src, args.dest, args.to, args.base_model)
    except (ExportError, AdapterConversionError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"converted {args.src} to {out} ({args.to})")
    if args.verify:
        peft_dir, mlx_dir = (args.src, out) if args.to == "mlx" else (out, args.src)
        base = args.base_model or base_model_of(peft_dir)
        return _run_verify(peft_dir, mlx_dir, base, args.verify_tol)
    return 0
