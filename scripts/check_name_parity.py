"""Check that the torch and MLX islands see the same trainable tensors.

Run before any heterogeneous (torch + MLX) run. Builds the torch/peft adapter the
torch island would train (`yeto.learner.attach_lora` + `TorchWeights`) and the MLX
adapter the MLX island would train (`yeto.mlx.lora`), and compares canonical
names, shapes and flat order. Only shapes are needed: the torch model is built on
the meta device and the MLX weights are loaded lazily, so this is quick and light
even for large models.

    python scripts/check_name_parity.py --model runs/demo/model [--lora-targets auto]
        [--lora-r 16]

Prints one row per tensor and a last line `parity: OK, N tensors` (exit 0), or
names the first mismatch (exit 1). `--mlx-lora-r` / `--mlx-lora-targets` check an
MLX island configured differently from the torch one.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PREFIX = "base_model.model."


def torch_layout(model: str, r: int, alpha: float, targets: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from yeto.torch.model import attach_lora
    from yeto.torch.weights import TorchWeights

    config = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config)
    return TorchWeights(attach_lora(base, r, alpha, targets, seed=0), "lora").layout


def mlx_layout(model: str, r: int, alpha: float, targets: str):
    from yeto.mlx.learner import build_lora_model
    from yeto.mlx.lora import LoRAWeights
    from yeto.mlx.shims import resolve_model_dir

    _, _, layers = build_lora_model(resolve_model_dir(model), r, alpha, targets, seed=0,
                                    lazy=True)
    return LoRAWeights(layers).layout


def _shape(spec) -> str:
    return "-" if spec is None else "x".join(map(str, spec.shape))


def compare(t, m) -> tuple[list[str], str | None]:
    """Table rows and the first mismatch (None when the layouts are identical)."""
    rows, first = [], None
    width = max(len(s.name) - len(PREFIX) for s in [*t.specs, *m.specs])
    rows.append(f"{'#':>4}  {'canonical name (base_model.model. ...)':<{width}}  "
                f"{'torch':>12}  {'mlx':>12}")
    for i in range(max(len(t.specs), len(m.specs))):
        a = t.specs[i] if i < len(t.specs) else None
        b = m.specs[i] if i < len(m.specs) else None
        ok = a is not None and b is not None and a == b
        name = (a or b).name
        if a is not None and b is not None and a.name != b.name:
            name = f"{a.name} | mlx: {b.name[len(PREFIX):]}"
        rows.append(f"{i:>4}  {name[len(PREFIX):]:<{width}}  {_shape(a):>12}  {_shape(b):>12}"
                    f"{'' if ok else '  <-- differs'}")
        if not ok and first is None:
            if a is None or b is None:
                side, extra = ("torch", a) if b is None else ("mlx", b)
                first = (f"tensor #{i}: only {side} has {extra.name} {list(extra.shape)} "
                         f"(torch {len(t.specs)} tensors, mlx {len(m.specs)})")
            else:
                first = (f"tensor #{i}: torch has {a.name} {list(a.shape)}, "
                         f"mlx has {b.name} {list(b.shape)}")
    return rows, first


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="check_name_parity.py",
        description="Compare the canonical LoRA tensor names, shapes and order of the torch "
                    "and MLX islands for a model.")
    p.add_argument("--model", required=True, help="local Hugging Face model dir")
    p.add_argument("--lora-targets", default="auto", help="auto | attention | all-linear | list")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank")
    p.add_argument("--lora-alpha", type=float, default=32)
    p.add_argument("--mlx-lora-r", type=int, default=None,
                   help="rank of the MLX island (default: --lora-r)")
    p.add_argument("--mlx-lora-targets", default=None,
                   help="targets of the MLX island (default: --lora-targets)")
    p.add_argument("--quiet", action="store_true", help="print only the last line")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    warnings.filterwarnings("ignore")
    from yeto.mlx import INSTALL_HINT, mlx_available

    if not mlx_available():
        print(f"parity: cannot check, {INSTALL_HINT}")
        return 2
    try:
        t = torch_layout(args.model, args.lora_r, args.lora_alpha, args.lora_targets)
        m = mlx_layout(args.model, args.mlx_lora_r or args.lora_r, args.lora_alpha,
                       args.mlx_lora_targets or args.lora_targets)
    except (OSError, ValueError) as e:
        print(f"parity: cannot check: {e}")
        return 2
    rows, first = compare(t, m)
    if not args.quiet:
        print("\n".join(rows))
        print(f"torch fingerprint {t.fingerprint[:16]}  mlx fingerprint {m.fingerprint[:16]}")
    if first is None and t.fingerprint == m.fingerprint:
        print(f"parity: OK, {len(t.specs)} tensors")
        return 0
    print(f"parity: MISMATCH at {first}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
