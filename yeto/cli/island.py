"""`yeto island`: a torch or an MLX island (`--backend`), the same program and flags as
``python -m yeto.learner`` / ``python -m yeto.mlx.learner``; `yeto rl`: the GRPO island, torch
or MLX by its own `--backend` (``python -m yeto.rl``; torch is its default)."""

from __future__ import annotations

import argparse
import sys

from yeto.backends import BACKENDS, default_backend
from yeto.signals import island_process


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--backend", choices=tuple(BACKENDS), default=None)
    known, rest = pre.parse_known_args(argv)
    entry = BACKENDS[known.backend or default_backend()]
    if "-h" in rest or "--help" in rest:
        print(f"yeto island [--backend {'|'.join(BACKENDS)}] (default: torch when torch, "
              "transformers and peft are installed, else mlx), then the flags of the "
              f"{entry.name} island, python -m {entry.module}:\n")
    return island_process(entry.program().main, rest)


def main_rl(argv=None) -> int:
    from yeto.rl.cli import main as rl

    return island_process(rl, argv)
