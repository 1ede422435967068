"""`yeto make-tiny-model` and `yeto make-task`: the arguments, over `yeto.testing`."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

from yeto.testing.shapes import SHAPES, make_shaped_model, shape_help
from yeto.testing.tasks import make_task
from yeto.testing.tiny import ARCHS, DEFAULT_SIZE, MODEL_SIZES, make_tiny_model


def main_make_tiny_model(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="yeto make-tiny-model",
        description="Build a tiny local causal LM (2 layers, hidden 128, 1024-token BPE\n"
        "tokenizer with a ChatML template) as a Hugging Face model dir. No network.\n"
        "--size small: 4 layers, hidden 256, the same tokenizer (over 2M parameters).\n"
        "Cached under $YETO_CACHE (default ~/.cache/yeto).\n\n"
        "With --shape, write instead a random-weight model with the exact configuration\n"
        "of a real small model (float32, not cached) and a local 4k-token tokenizer, for\n"
        "parity at real dimensions and memory/speed benchmarks.",
        epilog="shapes (--shape NAME):\n" + shape_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dir", type=Path, help="output model directory")
    p.add_argument("--arch", choices=ARCHS, default=None, help="architecture (default llama)")
    p.add_argument("--size", choices=list(MODEL_SIZES), default=None,
                   help="tiny model size: " + ", ".join(
                       f"{k} ({v['num_hidden_layers']} layers, hidden {v['hidden_size']})"
                       for k, v in MODEL_SIZES.items()) + f" (default {DEFAULT_SIZE})")
    p.add_argument("--shape", choices=list(SHAPES), default=None, metavar="NAME",
                   help="real-shape preset, random weights: "
                   + ", ".join(f"{k} ({v.params / 1e6:.0f}M)" for k, v in SHAPES.items()))
    p.add_argument("--config-only", action="store_true",
                   help="with --shape: write config, generation config and tokenizer, no weights")
    p.add_argument("--seed", type=int, default=0, help="seed for tokenizer data and weights")
    p.add_argument(
        "--no-pretrain",
        dest="pretrain",
        action="store_false",
        help="skip the short pretraining and write random-init weights",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.shape is None:
        if args.config_only:
            p.error("--config-only needs --shape, e.g. --shape smollm2-135m --config-only")
        arch, size = args.arch or "llama", args.size or DEFAULT_SIZE
        out = make_tiny_model(args.dir, arch=arch, seed=args.seed, pretrain=args.pretrain,
                              size=size)
        print(f"wrote {size} {arch} model to {out}")
        return 0
    if args.size is not None:
        p.error(f"--shape {args.shape} fixes the model's size; drop --size")
    if args.arch is not None:
        p.error(f"--shape {args.shape} fixes the architecture ({SHAPES[args.shape].arch}); "
                "drop --arch")
    out = make_shaped_model(args.dir, args.shape, seed=args.seed, config_only=args.config_only)
    what = "config + tokenizer (no weights)" if args.config_only else "random-weight model"
    print(f"wrote {args.shape} {what} to {out}: {SHAPES[args.shape].arch}, "
          f"{SHAPES[args.shape].params:,} parameters")
    return 0


def main_make_task(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="yeto make-task",
        description='Write a synthetic chat fine-tuning task ("reverse: apple river stone" '
        '-> "stone river apple") as DIR/train.jsonl and DIR/eval.jsonl (disjoint prompts).',
    )
    p.add_argument("dir", type=Path, help="output directory")
    p.add_argument("--n-train", type=int, default=2000, help="training rows (default 2000)")
    p.add_argument("--n-eval", type=int, default=200, help="held-out rows (default 200)")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    args = p.parse_args(argv)
    train, held_out = make_task(args.dir, n_train=args.n_train, n_eval=args.n_eval, seed=args.seed)
    print(f"wrote {args.n_train} rows to {train} and {args.n_eval} rows to {held_out}")
    return 0
