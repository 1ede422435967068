"""The `yeto` command."""

from __future__ import annotations

import sys

COMMANDS = {
    "demo": ("yeto.cli.demo", "main", "a local federated run on a tiny model built here"),
    "launch": ("yeto.cli.launch", "main",
               "a syncer + islands as local processes, with a live display"),
    "status": ("yeto.cli.status", "main", "a running syncer's islands, round, bytes (HOST:PORT)"),
    "credential": ("yeto.cli.credential", "main",
                   "each island's own credential, from the run's token"),
    "export": ("yeto.interop.export", "main_export",
               "a run's adapter (state dir) as a peft or mlx-lm adapter"),
    "convert": ("yeto.interop.export", "main_convert",
                "convert a LoRA adapter between peft and mlx-lm, exactly"),
    "make-tiny-model": ("yeto.cli.make", "main_make_tiny_model",
                        "write a tiny Llama/Qwen2-style model dir with a local tokenizer"),
    "make-task": ("yeto.cli.make", "main_make_task",
                  "write the synthetic chat task (train.jsonl, eval.jsonl)"),
    "data": ("yeto.cli.data", "main",
             "check a data source with a model's tokenizer: format, tokens, loss mask"),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: yeto COMMAND [ARGS]   (yeto COMMAND --help for details)\n\ncommands:")
        for name, (_, _, text) in COMMANDS.items():
            print(f"  {name:18s} {text}")
        print("\nislands and the syncer: python -m yeto.learner, python -m yeto.mlx.learner, "
              "python -m syncer")
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"yeto: unknown command {argv[0]!r}; try: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[argv[0]]
    import importlib

    return getattr(importlib.import_module(module), func)(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
