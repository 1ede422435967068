"""yeto: DiLoCo-style federated fine-tuning across mixed hardware.

The core (layout, codec, client, island) is backend-neutral and works on numpy
arrays; torch lives in `yeto.learner`, MLX in `yeto.mlx`.

Its packages:

- `yeto.cli`: the `yeto` command, one subcommand per role;
- `yeto.island`: the island's state machine, backend-neutral;
- `yeto.client`: the island's gRPC client of the syncer;
- `yeto.codec`: the wire codec (f32, bf16, q4, error feedback);
- `yeto.data`: training data: sources, formats, packing, provenance;
- `yeto.torch`: the torch island; `yeto.mlx`: the MLX island;
- `yeto.rl`: GRPO islands; `yeto.rollout`: rollout nodes;
- `yeto.interop`: adapters on disk, export, DiLoCo for existing training scripts;
- `yeto.sim`: a fleet in one process, and the fleet-scale model;
- `yeto.testing`: tiny models, tasks and harnesses for the demo and the tests;
- `yeto.proto`: the gRPC messages (generated from `yeto.proto`).

Its modules:

- `yeto.backends`: the island backends by name (`--backend NAME`);
- `yeto.config`: an island's settings (`IslandConfig`);
- `yeto.learner`: `python -m yeto.learner`, the torch island;
- `yeto.loop`: the island driver and the island program, written once;
- `yeto.transport`: what an island needs from the syncer, as an interface;
- `yeto.layout`: canonical tensor layout, fragments and the layout fingerprint;
- `yeto.wire`: pushes and broadcasts as wire bytes, without protobuf copies;
- `yeto.net`: chunking, auth and addresses, shared by islands and the syncer;
- `yeto.targets`: which linears get LoRA, for torch and MLX alike;
- `yeto.frozen`: frozen LoRA A factors drawn from a shared seed;
- `yeto.gguf`: a GGUF checkpoint as a Hugging Face model dir;
- `yeto.runfile`: the run file (`--config run.toml`) every program reads;
- `yeto.metrics`: metrics as JSONL files and TensorBoard scalars;
- `yeto.signals`: stopping on SIGINT/SIGTERM;
- `yeto.memory`: freed memory given back to the operating system;
- `yeto.io`: atomic files, finite numbers, addresses, the cache home;
- `yeto.display`: tables and a live view (`rich`), for the `yeto` command and the scripts;
- `yeto.version`: the version number.
"""

from typing import Any

from yeto.version import __version__ as __version__


# the Python API for custom training scripts, imported on first use
def __getattr__(name: str) -> Any:
    if name in ("DiLoCo", "DiLoCoCallback", "MLXDiLoCo"):
        from yeto.interop import integrations

        return getattr(integrations, name)
    raise AttributeError(f"module 'yeto' has no attribute {name!r}")
