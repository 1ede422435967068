"""`yeto check-parity --model DIR`: do the torch and MLX islands train the same tensors of
the same model?

Run before any heterogeneous (torch + MLX) run. Builds the torch/peft adapter the
torch island would train (`yeto.torch.model.attach_lora` + `TorchWeights`) and the
MLX adapter the MLX island would train (`yeto.mlx.learner.build_lora_model` +
`LoRAWeights`), and compares canonical names, shapes and flat order (from shapes
only: a meta-device torch model, lazily loaded MLX weights). Then, unless
``--no-logits``, it sets the same seeded random non-zero adapter in both and runs
both on the same token ids (`yeto.interop.parity`): names can agree while the two
backends compute different functions. A checkpoint over 1 GiB is compared on a copy
truncated to its first ``--numeric-layers`` (default 2) decoder layers, and the
output says so.

    yeto check-parity --model runs/demo/model [--lora-targets auto] [--lora-r 16]
        [--numeric-layers N] [--no-logits]

Prints one row per tensor, then as the last line `parity: OK, N tensors, max |dlogit|
X` (exit 0), or the first mismatch (exit 1). LoRA tensors on mixture-of-experts
experts (fused expert weights with ``--lora-targets all-linear`` or ``experts``) are
counted (`N tensors (M on experts)`), and their adapter is also compared alone
(every other LoRA tensor zero), so an expert LoRA applied differently cannot hide
behind the attention adapter. A model the islands cannot both build
exits 2 with the reason. `--mlx-lora-r` / `--mlx-lora-targets` check an MLX island
configured differently from the torch one (names only).
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings

# a problem of the model or the libraries (exit 2), not a mismatch between islands (exit 1)
UNSUPPORTED = {"tiny", "mlx-import", "torch-build", "torch-targets", "mlx-load", "mlx-targets",
               "forward"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="yeto check-parity",
        description="Compare the canonical LoRA tensor names, shapes and order of the torch "
                    "and MLX islands for a model, and their logits with the same adapter.")
    p.add_argument("--model", required=True, help="local Hugging Face model dir")
    p.add_argument("--lora-targets", default="auto", help="auto | attention | all-linear | list")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank")
    p.add_argument("--lora-alpha", type=float, default=32)
    p.add_argument("--mlx-lora-r", type=int, default=None,
                   help="rank of the MLX island (default: --lora-r)")
    p.add_argument("--mlx-lora-targets", default=None,
                   help="targets of the MLX island (default: --lora-targets)")
    p.add_argument("--no-logits", action="store_true", help="compare names only")
    p.add_argument("--numeric-layers", type=int, default=None,
                   help="compare logits on a copy with only the first N decoder layers "
                        "(default: the whole model up to 1 GiB of weights, else 2)")
    p.add_argument("--rel-tol", type=float, default=None,
                   help="pass when max |dlogit| <= REL_TOL x max |logit| (default 1e-4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the adapter and token ids")
    p.add_argument("--quiet", action="store_true", help="print only the last line")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    warnings.filterwarnings("ignore")
    from yeto.mlx import INSTALL_HINT, mlx_available

    if not mlx_available():
        print(f"parity: cannot check, {INSTALL_HINT}")
        return 2
    from transformers.utils import logging as hf_logging

    from yeto.interop import parity

    hf_logging.disable_progress_bar()
    try:
        rep = parity.check(args.model, args.lora_r, args.lora_alpha, args.lora_targets,
                           args.mlx_lora_r, args.mlx_lora_targets, logits=not args.no_logits,
                           numeric_layers=args.numeric_layers, seed=args.seed)
    except parity.ParityError as e:
        if e.stage in UNSUPPORTED:
            print(f"parity: cannot check ({parity.STAGES.get(e.stage, e.stage)}): {e.args[0]}")
            return 2
        print(f"parity: MISMATCH ({e.stage}): {e.args[0]}")
        return 1
    except (OSError, ValueError) as e:
        print(f"parity: cannot check: {e}")
        return 2
    return report(rep, parity.REL_TOL if args.rel_tol is None else args.rel_tol, args.quiet)


def report(rep, rel_tol: float, quiet: bool) -> int:
    """Print a `yeto.interop.parity.Report` (its last line: OK or the first mismatch)
    and return the exit status: 0 when names and logits agree, 1 when not."""
    if not quiet:
        print("\n".join(rep.rows))
        print(f"torch fingerprint {rep.torch_fingerprint[:16]}  "
              f"mlx fingerprint {rep.mlx_fingerprint[:16]}")
        for note in rep.notes:
            print(f"note: {note}")
    if not rep.names_ok:
        print(f"parity: MISMATCH at {rep.first_mismatch or 'the layout fingerprint'}")
        return 1
    experts = f" ({rep.n_expert_tensors} on experts)" if rep.n_expert_tensors else ""
    if rep.max_dlogit is None:
        print(f"parity: OK, {rep.n_tensors} tensors{experts} (names only)")
        return 0
    if not quiet:
        where = (f"first {rep.numeric_layers} layers" if rep.numeric_layers else "whole model")
        print(f"logits ({where}): max |dlogit| {rep.max_dlogit:.3g}, max |logit| "
              f"{rep.max_logit:.3g}, adapter moves logits by up to {rep.adapter_effect:.3g}, "
              f"without the adapter max |dlogit| {rep.base_dlogit:.3g}")
        if rep.expert_dlogit is not None:
            print(f"experts ({rep.n_expert_tensors} tensors) alone: adapter moves logits by up "
                  f"to {rep.expert_effect:.3g}, max |dlogit| {rep.expert_dlogit:.3g}")
    if not rep.logits_ok(rel_tol):
        worst = max(rep.max_dlogit, rep.expert_dlogit or 0.0)
        alone = " (the expert adapter alone)" if worst > rep.max_dlogit else ""
        print(f"parity: MISMATCH in logits{alone}: max |dlogit| {worst:.3g} > {rel_tol:g} x "
              f"max |logit| {rep.max_logit:.3g}")
        return 1
    where = f" (logits of the first {rep.numeric_layers} layers)" if rep.numeric_layers else ""
    print(f"parity: OK, {rep.n_tensors} tensors{experts}, max |dlogit| "
          f"{rep.max_dlogit:.3g}{where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
