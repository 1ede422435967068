"""The island backends by name: what `--backend NAME` runs, in one table.

Each entry names the island program (``python -m MODULE``, whose ``main(argv)`` runs
an island), the `yeto.loop.Backend` class that program builds (the GRPO island builds
the same one), the packages it needs, and what to install and where it runs, for the
commands `yeto launch` prints for islands on other machines. Nothing here imports a
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
    ``"module:Class"`` of its `yeto.loop.Backend`."""

    name: str
    module: str
    backend: str
    requires: tuple[str, ...]
    install: str
    where: str

    def program(self) -> ModuleType:
        """The island program's module (its ``main(argv) -> int`` runs one island)."""
        return importlib.import_module(self.module)

    def backend_class(self) -> type:
        """The `yeto.loop.Backend` class, imported now; built as ``cls(cfg)``."""
        module, _, cls = self.backend.partition(":")
        return getattr(importlib.import_module(module), cls)

    def installed(self) -> bool:
        """True when every package the backend imports is installed (none is imported)."""
        return all(importlib.util.find_spec(m) is not None for m in self.requires)


BACKENDS: dict[str, BackendEntry] = {b.name: b for b in (
    BackendEntry("torch", "yeto.learner", "yeto.torch.learner:TorchBackend",
                 ("torch", "transformers", "peft"), 'pip install "yeto[torch]"',
                 "a torch island (Linux/Windows, CUDA or CPU)"),
    BackendEntry("mlx", "yeto.mlx.learner", "yeto.mlx.learner:MLXBackend",
                 ("mlx", "mlx_lm"), 'pip install "yeto[mlx]"',
                 "an MLX island (Apple silicon; Linux CPU works too)"),
)}


def default_backend() -> str:
    """torch when torch, transformers and peft are installed, else mlx."""
    return "torch" if BACKENDS["torch"].installed() else "mlx"
