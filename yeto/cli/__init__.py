"""The `yeto` command: one entry for every role. Each subcommand runs the same `main`
(and so the same parser) as its `python -m` form, which works as well.

- `island`: `yeto island` (torch or MLX) and `yeto rl`;
- `launch`: `yeto launch`, a syncer and its islands as local processes;
- `local_run`: those processes: started, reserved slots, stopped in order;
- `join`: external island slots of `yeto launch` and the command that joins one;
- `progress`: what a local run's files and its syncer say (`Progress`);
- `launch_view`: what `yeto launch` shows, live or a line per round;
- `demo`: `yeto demo`, a complete local run on a tiny model built here;
- `status`: `yeto status HOST:PORT`, where a running syncer stands;
- `credential`: `yeto credential ID...`, each island's own credential;
- `data`: `yeto data`, a data source checked the way an island will read it;
- `make`: `yeto make-tiny-model` and `yeto make-task`;
- `parity`: `yeto check-parity`, torch and MLX islands on one model;
- `reference`: the docs/reference/ pages, generated from the parsers.
"""

from __future__ import annotations

import importlib
import sys

# role -> {command: (module, function, what it does)}
GROUPS = {
    "run a federated job": {
        "syncer": ("syncer.__main__", "main", "the syncer: quorum, merge, outer step "
                   "(= python -m syncer)"),
        "island": ("yeto.cli.island", "main", "an island, torch or MLX (--backend; = python "
                   "-m yeto.learner / yeto.mlx.learner)"),
        "launch": ("yeto.cli.launch", "main",
                   "a syncer + islands as local processes, with a live display"),
        "demo": ("yeto.cli.demo", "main", "a local federated run on a tiny model built here"),
        "sim": ("yeto.sim.__main__", "main", "a syncer and k islands in one process, on real "
                "or simulated time (= python -m yeto.sim)"),
    },
    "reinforcement learning": {
        "rl": ("yeto.cli.island", "main_rl", "a GRPO island sampling from rollout nodes "
               "(= python -m yeto.rl)"),
        "rollout": ("yeto.rollout.cli", "main", "a rollout node: token ids and logprobs over "
                    "HTTP (= python -m yeto.rollout)"),
    },
    "watch and secure a run": {
        "status": ("yeto.cli.status", "main",
                   "a running syncer's islands, round, bytes (HOST:PORT)"),
        "credential": ("yeto.cli.credential", "main",
                       "each island's own credential, from the run's token"),
    },
    "results and data": {
        "export": ("yeto.interop.export", "main_export",
                   "a run's adapter (state dir) as a peft or mlx-lm adapter"),
        "convert": ("yeto.interop.export", "main_convert",
                    "convert a LoRA adapter between peft and mlx-lm, exactly"),
        "data": ("yeto.cli.data", "main",
                 "check a data source with a model's tokenizer: format, tokens, loss mask"),
        "make-tiny-model": ("yeto.cli.make", "main_make_tiny_model",
                            "write a tiny Llama/Qwen2-style model dir with a local tokenizer"),
        "make-task": ("yeto.cli.make", "main_make_task",
                      "write the synthetic chat task (train.jsonl, eval.jsonl)"),
        "check-parity": ("yeto.cli.parity", "main",
                         "torch and MLX islands on a model: same LoRA tensors, same logits"),
    },
}
COMMANDS = {name: spec for group in GROUPS.values() for name, spec in group.items()}


def usage() -> str:
    lines = ["usage: yeto COMMAND [ARGS]   (yeto COMMAND --help for details; every program "
             "takes --config RUN.toml)"]
    for title, commands in GROUPS.items():
        lines += ["", f"{title}:"] + [f"  {name:16s} {text}"
                                      for name, (_, _, text) in commands.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"yeto: unknown command {argv[0]!r}; try: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[argv[0]]
    return getattr(importlib.import_module(module), func)(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
