"""What the MLX island refuses before training."""

from __future__ import annotations


class UnsupportedConfig(ValueError):
    """A config transformers accepts that mlx-lm cannot represent; the message names
    the field, its value and the mlx-lm file that cannot hold it."""


def mlx_file(model_or_cls) -> str:
    """``mlx-lm's <file>.py`` for an mlx-lm model or class: the file an
    `UnsupportedConfig` names."""
    module = getattr(model_or_cls, "__module__", "mlx_lm")
    return f"mlx-lm's {module.rsplit('.', 1)[-1]}.py"
