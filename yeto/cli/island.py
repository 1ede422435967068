"""`yeto island`: a torch or an MLX island (`--backend`), the same program and flags as
``python -m yeto.learner`` / ``python -m yeto.mlx.learner``; `yeto rl`: the GRPO island, torch
or MLX by its own `--backend` (``python -m yeto.rl``; torch is its default)."""

from __future__ import annotations

import argparse
import importlib.util
import sys

from yeto.signals import island_process

BACKENDS = {"torch": "yeto.torch.learner", "mlx": "yeto.mlx.learner"}


def default_backend() -> str:
    """torch when torch, transformers and peft are installed, else mlx."""
    have = all(importlib.util.find_spec(m) for m in ("torch", "transformers", "peft"))
    return "torch" if have else "mlx"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--backend", choices=tuple(BACKENDS), default=None)
    known, rest = pre.parse_known_args(argv)
    backend = known.backend or default_backend()
    if "-h" in rest or "--help" in rest:
        print(f"yeto island [--backend {'|'.join(BACKENDS)}] (default: torch when torch, "
              "transformers and peft are installed, else mlx), then the flags of the "
              f"{backend} island, python -m {BACKENDS[backend].replace('.torch', '')}:\n")
    learner = importlib.import_module(BACKENDS[backend])
    return island_process(learner.main, rest)


def main_rl(argv=None) -> int:
    from yeto.rl.cli import main as rl

    return island_process(rl, argv)
