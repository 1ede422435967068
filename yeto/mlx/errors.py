"""What the MLX island refuses before training."""

from __future__ import annotations


class UnsupportedConfig(ValueError):
    """A config transformers accepts that mlx-lm cannot represent; the message names
    the field, its value and the mlx-lm file that cannot hold it."""
