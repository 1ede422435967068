"""The MLX island: `python -m yeto.mlx.learner`.

- `yeto.mlx.lora`: a peft-shaped `LoRALinear` (``lora_A`` (r, in), ``lora_B``
  (out, r), ``y = base(x) + (alpha/r)·x·Aᵀ·Bᵀ``), LoRA attachment with the same
  target selection as the torch island, and the flat-vector view of the LoRA
  weights under canonical peft names;
- `yeto.mlx.shims`: loading a Hugging Face model dir with mlx-lm when newer
  transformers wrote its config;
- `yeto.mlx.learner`: the island itself.

Importing this package does not import mlx; the submodules do. Install with
``pip install 'yeto[mlx]'``.
"""

from __future__ import annotations

INSTALL_HINT = ("the MLX island needs mlx and mlx-lm: pip install 'yeto[mlx]' "
                "(Apple silicon, or Linux CPU with mlx[cpu])")


def mlx_available() -> bool:
    """True when mlx and mlx-lm import."""
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except ImportError:
        return False
    return True
