"""Batched rollouts of a hybrid model (LFM2: short-conv blocks beside attention):
completion tokens per second of one batch against the same rows sampled one at a
time, on each backend's rollout engine.

Goal: a rollout node samples a GRPO batch of a hybrid model (P prompts x G
completions) as one batch, with the conv and recurrent states batched as the keys
and values are (`yeto.rollout.torch_cache`, `yeto.rollout.mlx_engine`), so it is
faster than sampling the rows one after another, as it is for attention-only models.

Both arms run `yeto.rollout.generate.generate` on the same engine and weights (the
tiny random-weight model of `yeto.testing.servable` with a random LoRA): "batched"
is one call over all P x G rows (each prompt prefilled once, shared by its G rows);
"sequential" is one call per row (P x G prefills). EOS is ignored, so every row has
M tokens. Measured interleaved, best of --repeat.

The last line is `RESULT ratio=<torch batched tok/s / sequential tok/s>` with the
MLX ratio and each rate.

    python scripts/bench_rollout_hybrid.py            # P=8 x G=8 x M=32
    python scripts/bench_rollout_hybrid.py --quick    # P=4 x G=4 x M=16, one repeat
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from _bench import interleaved, parser, result_line

from yeto.display import markdown_table, print_table


def _args():
    p = parser(__doc__.split("\n\n")[0], __doc__.split("\n\n", 1)[1])
    p.add_argument("--arch", default="lfm2", help="model type of the tiny model (a hybrid)")
    p.add_argument("--hidden", type=int, default=0,
                   help="hidden size (feed-forward 2x, 4 heads) instead of the tiny 64, for a "
                        "model whose arithmetic outweighs the per-step overhead")
    p.add_argument("--prompts", type=int, default=8, help="P: prompts per batch")
    p.add_argument("--group-size", type=int, default=8, help="G: completions per prompt")
    p.add_argument("--max-tokens", type=int, default=32, help="M: tokens per completion")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0: torch's default)")
    p.add_argument("--backends", default="torch,mlx")
    return p.parse_args()


def _engine(backend: str, model_dir: Path):
    import numpy as np

    if backend == "mlx":
        from yeto.rollout.mlx_engine import MLXEngine

        engine = MLXEngine(model_dir)
    else:
        from yeto.rollout.torch_engine import TorchEngine

        engine = TorchEngine(model_dir)
    engine.set_weights(np.random.default_rng(1).normal(0, 0.05, engine.layout.numel)
                       .astype(np.float32))
    return engine


def arms(engine, p: int, g: int, m: int) -> dict:
    """The two arms over one workload: P prompts of 8 to 8 + P - 1 tokens, G rows each,
    seeded sampling at T=1; each returns the completion tokens it sampled."""
    from yeto.rollout.generate import SamplingParams, generate, make_rows

    prompts = [[(7 * i + j) % 900 + 10 for j in range(8 + i)] for i in range(p)]
    params = SamplingParams(max_tokens=m, temperature=1.0, seed=0, ignore_eos=True)

    def rows():
        return [r for i, q in enumerate(prompts) for r in make_rows(q, params, g, i)]

    def batched():
        return sum(len(o.token_ids) for o in generate(engine, rows(), [], lambda ids: ""))

    def sequential():
        return sum(len(generate(engine, [r], [], lambda ids: "")[0].token_ids) for r in rows())

    return {"batched": batched, "sequential": sequential}


def measure(args, backend: str, model_dir: Path) -> dict:
    engine = _engine(backend, model_dir)
    fns = arms(engine, args.prompts, args.group_size, args.max_tokens)
    tokens = {k: fn() for k, fn in fns.items()}  # warm up, and count
    best = interleaved(fns, args.repeat)
    return {k: tokens[k] / best[k] for k in fns}


def main() -> int:
    args = _args()
    if args.quick:
        args.prompts, args.group_size, args.max_tokens, args.repeat = 4, 4, 16, 1
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from yeto.testing.servable import servable_model

    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        sizes = ({"hidden_size": args.hidden, "intermediate_size": 2 * args.hidden,
                  "head_dim": args.hidden // 4} if args.hidden else {})
        model_dir = servable_model(args.arch, Path(tmp) / args.arch, overrides=sizes)
        for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
            try:
                rates[backend] = measure(args, backend, model_dir)
            except ImportError as e:
                print(f"{backend}: not measured ({e})", file=sys.stderr)
    rows = [[b, f"{r['batched']:.0f}", f"{r['sequential']:.0f}",
             f"{r['batched'] / r['sequential']:.2f}x"] for b, r in rates.items()]
    headers = ["engine", "batched tok/s", "sequential tok/s", "ratio"]
    print(f"\n{args.arch} (hidden {args.hidden or 64}): P={args.prompts} x G={args.group_size} "
          f"x M={args.max_tokens}, best of {args.repeat}")
    print_table(headers, rows)
    print(markdown_table(headers, rows))
    kv = {f"{b}_{k}_tok_s": v for b, r in rates.items() for k, v in r.items()}
    t, m = rates.get("torch"), rates.get("mlx")
    ratio = t["batched"] / t["sequential"] if t else float("nan")
    print(result_line(ratio, mlx_ratio=m["batched"] / m["sequential"] if m else "n/a", **kv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
