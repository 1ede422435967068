"""yeto: DiLoCo-style federated fine-tuning across mixed hardware.

The core (layout, codec, client, island) is backend-neutral and works on numpy
arrays; torch lives in `yeto.learner`, MLX in `yeto.mlx`.
"""

from typing import Any

from yeto.version import __version__ as __version__


# the Python API for custom training scripts, imported on first use
def __getattr__(name: str) -> Any:
    if name in ("DiLoCo", "DiLoCoCallback", "MLXDiLoCo"):
        from yeto.interop import integrations

        return getattr(integrations, name)
    raise AttributeError(f"module 'yeto' has no attribute {name!r}")
