"""The island backends by name: what `--backend NAME` runs, in one table.

Each entry names the island program (``python -m MODULE``, whose ``main(argv)`` runs
an island), the `yeto.loop.Backend` class that program builds (the GRPO island builds
the same one), the GRPO island's step on that backend (`yeto.rl.trainer.Policy`), the
packages it needs, and what to install and where it runs, for the commands
`yeto launch` prints for islands on other machines. Nothing here imports a
backend: `program` and `backend_class` import it when asked.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class BackendEntry:
    """One island backend: `module` is the island program, `backend` the
    ``"module:Class"`` of its `yeto.loop.Backend`, `grpo` that of its GRPO policy."""

    name: str
    module: str
    backend: str
    grpo: str
    requires: tuple[str, ...]
    install: str
    where: str

    def program(self) -> ModuleType:
        """The island program's module (its ``main(argv) -> int`` runs one island)."""
        return importlib.import_module(self.module)

    def backend_class(self) -> type:
        """The `yeto.loop.Backend` class, imported now; built as ``cls(cfg)``."""
        return _load(self.backend)

    def grpo_class(self) -> type:
        """The GRPO island's `yeto.rl.trainer.Policy` class on this backend, imported
        now; built as ``cls(backend, clip_eps, kl_coef, model_dir)``."""
        return _load(self.grpo)

    def installed(self) -> bool:
        """True when every package the backend imports is installed (none is imported)."""
        return all(importlib.util.find_spec(m) is not None for m in self.requires)


BACKENDS: dict[str, BackendEntry] = {b.name: b for b in (
    BackendEntry("torch", module="yeto.learner", backend="yeto.torch.learner:TorchBackend",
                 grpo="yeto.rl.grpo:TorchGRPO", requires=("torch", "transformers", "peft"),
                 install='pip install "yeto[torch]"',
                 where="a torch island (Linux/Windows, CUDA or CPU)"),
    BackendEntry("mlx", module="yeto.mlx.learner", backend="yeto.mlx.learner:MLXBackend",
                 grpo="yeto.mlx.grpo:MLXGRPO", requires=("mlx", "mlx_lm"),
                 install='pip install "yeto[mlx]"',
                 where="an MLX island (Apple silicon; Linux CPU works too)"),
)}


def _load(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def default_backend() -> str:
    """torch when torch, transformers and peft are installed, else mlx."""
    return "torch" if BACKENDS["torch"].installed() else "mlx"
