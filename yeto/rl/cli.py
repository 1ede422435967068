"""`python -m yeto.rl`: a GRPO island (see `yeto.rl.trainer`).

Example (two rollout nodes observing the syncer of the run; add --backend mlx for an
MLX trainer):
    python -m yeto.rl --model runs/demo/model --adapter runs/sft/adapter \\
        --data runs/demo/data/train.jsonl --eval-data runs/demo/data/eval.jsonl \\
        --rollout-url http://127.0.0.1:8080/v1 --rollout-url http://127.0.0.1:8081/v1 \\
        --reward reversal_accuracy --syncer 127.0.0.1:29400 --sync-every 2 --output runs/rl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from yeto.backends import BACKENDS
from yeto.config import HelpFormatter, add_island_args, parse_island_args
from yeto.rl.rewards import BUILTIN
from yeto.rl.trainer import RLConfig

EPILOG = __doc__.split("Example", 1)[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m yeto.rl", formatter_class=HelpFormatter,
        description="A GRPO island: samples G completions per prompt from rollout nodes "
                    "(python -m yeto.rollout), scores them, trains with GRPO, and syncs with "
                    "a yeto syncer like any island. --data holds the prompts (chat or "
                    "prompt/completion rows; the last assistant turn is the reference). It "
                    "joins as an RL island: a syncer on its default outer rule (--outer "
                    "auto) then merges by plain averaging, which kept GRPO's reward rising "
                    "where Nesterov momentum collapsed it (docs/how-it-works.md, \"The outer "
                    "rule\").",
        epilog="Example" + EPILOG)
    add_island_args(p)
    p.set_defaults(sync_every=2, max_steps=60, inner_lr=1e-3)
    g = p.add_argument_group("GRPO")
    g.add_argument("--backend", choices=tuple(BACKENDS), default="torch",
                   help="the trainer's tensor engine: torch (peft; --device, --threads), or "
                        "mlx (Apple silicon or Linux CPU; imports no torch); the same GRPO "
                        "step, and the island joins the same runs")
    g.add_argument("--rollout-url", action="append", default=[], required=True,
                   help="a rollout node (OpenAI/vLLM-compatible); repeat for several")
    g.add_argument("--reward", action="append", default=[],
                   help=f"built-in ({', '.join(BUILTIN)}) or module:function; several add up "
                        "(default reversal_accuracy)")
    g.add_argument("--eval-reward", action="append", default=[],
                   help="the held-out metric, as --reward (default: the training reward)")
    g.add_argument("--adapter", type=Path, default=None,
                   help="start from this peft or mlx-lm adapter (e.g. an SFT warm start)")
    g.add_argument("--group-size", type=int, default=8, help="G: completions per prompt")
    g.add_argument("--prompts-per-step", type=int, default=8)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--clip-eps", type=float, default=0.2, help="ratio clip ε")
    g.add_argument("--kl-coef", type=float, default=0.0, help="β of KL to the base model")
    g.add_argument("--no-scale-rewards", action="store_true",
                   help="advantages r − mean only (no division by the group's std)")
    g.add_argument("--micro-batch", type=int, default=64, help="sequences per forward pass")
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="0: no clipping")
    g.add_argument("--warmup-steps", type=int, default=0,
                   help="raise the learning rate linearly over the first steps")
    g.add_argument("--eval-prompts", type=int, default=64,
                   help="held-out prompts (from --eval-data) scored greedily (0 = all)")
    g.add_argument("--rollout-timeout", type=float, default=300.0, help="seconds per request")
    g.add_argument("--rollout-wait", type=float, default=600.0,
                   help="give up when no node answered for this long")
    g.add_argument("--rollout-api-key", default=None, help="the nodes' --api-key")
    g.add_argument("--rollout-model", default=None, help="model field sent to the nodes")
    g.add_argument("--update-nodes", action="store_true",
                   help="keep nodes that do not observe the syncer (vLLM, or yeto nodes "
                        "without --syncer) current: every --sync-every steps save the adapter "
                        "under --node-adapter-dir and load it on each node "
                        "(POST /v1/load_lora_adapter); a node that keeps serving older "
                        "weights is reported and skipped (yeto/rl/direct.py)")
    g.add_argument("--node-adapter-dir", type=Path, default=None,
                   help="with --update-nodes: where the adapters for the nodes are saved, "
                        "a folder every node reads at the same path (default: "
                        "OUTPUT/node-adapters)")
    g.add_argument("--async-rollouts", action="store_true",
                   help="draw the next step's samples from the rollout nodes while this step "
                        "trains (one step ahead, in a background thread), so sampling and "
                        "training overlap; samples are then up to one version older "
                        "(yeto/rl/overlap.py)")
    g.add_argument("--max-staleness", type=int, default=None,
                   help="drop a batch sampled on weights more than N versions behind the "
                        "trainer's, and draw its prompts again (counted as stale_dropped); "
                        "default 1 with --async-rollouts, no bound without")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (torch backend)")
    g.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0 = default; torch backend)")
    return p


def rl_config(args: argparse.Namespace) -> RLConfig:
    if args.adapter is not None:  # checked before the model loads
        from yeto.interop.export import ExportError, check_adapter

        try:
            check_adapter(args.adapter)
        except ExportError as e:
            raise SystemExit(f"error: --adapter: {e}") from None
    for name in ("group_size", "prompts_per_step", "max_new_tokens", "micro_batch"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be at least 1")
    if args.max_staleness is not None and args.max_staleness < 0:
        raise SystemExit("error: --max-staleness must be 0 or more (0: only samples from "
                         "the trainer's current weights)")
    if args.async_rollouts and args.update_nodes:
        raise SystemExit("error: --async-rollouts does not work with --update-nodes yet (a "
                         "batch drawn ahead would judge a node stale); use nodes that observe "
                         "the syncer (python -m yeto.rollout --syncer ...), or drop one flag")
    if args.group_size < 2:
        raise SystemExit("error: --group-size must be at least 2 (advantages are relative "
                         "within a group)")
    if args.backend == "mlx":
        from yeto.mlx import INSTALL_HINT, mlx_available

        if not mlx_available():
            raise SystemExit(f"error: --backend mlx: {INSTALL_HINT}; or use --backend torch")
        if args.lora_freeze_a:
            raise SystemExit("error: --lora-freeze-a is not supported by the MLX backend; drop "
                             "it, or use --backend torch")
    return RLConfig(
        rollout_url=args.rollout_url, reward=args.reward, backend=args.backend,
        group_size=args.group_size,
        prompts_per_step=args.prompts_per_step, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, clip_eps=args.clip_eps,
        kl_coef=args.kl_coef, scale_rewards=not args.no_scale_rewards, adapter=args.adapter,
        micro_batch=args.micro_batch, max_grad_norm=args.max_grad_norm,
        warmup_steps=args.warmup_steps, eval_reward=args.eval_reward or None,
        eval_prompts=args.eval_prompts, rollout_timeout=args.rollout_timeout,
        rollout_wait=args.rollout_wait, rollout_api_key=args.rollout_api_key,
        rollout_model=args.rollout_model, update_nodes=args.update_nodes,
        node_adapter_dir=args.node_adapter_dir, async_rollouts=args.async_rollouts,
        max_staleness=args.max_staleness)


def main(argv=None) -> int:
    p = build_parser()
    cfg = parse_island_args(p, argv, role="rl")
    rl = rl_config(p.parse_args(argv))
    from yeto.rl.run import run_grpo

    return run_grpo(cfg, rl)


if __name__ == "__main__":
    sys.exit(main())
