"""What mlx_lm/models/recurrent_gemma.py builds otherwise than transformers'
RecurrentGemma.

- Norm eps: the file builds its block norms with eps 1e-5 and only the final norm with
  the config's ``rms_norm_eps`` (1e-6 in RecurrentGemma checkpoints), which
  transformers uses everywhere (`block_norm_eps`).
- RoPE base: the file builds its attention's RoPE with base 10000 (the ``nn.RoPE``
  default); transformers rotates with the config's ``rope_theta`` (`rope_base`).
"""

from __future__ import annotations

from typing import Any


def block_norm_eps(model, args, config: dict[str, Any]) -> None:
    """Each block's two norms with the config's ``rms_norm_eps``."""
    for block in model.layers:
        for name in ("temporal_pre_norm", "channel_pre_norm"):
            getattr(block, name).eps = args.rms_norm_eps


def rope_base(model, args, config: dict[str, Any]) -> None:
    """Each attention block's RoPE with the config's ``rope_theta`` as its base."""
    theta = getattr(args, "rope_theta", None)
    for block in model.layers:
        rope = getattr(block.temporal_block, "rope", None)
        if theta and rope is not None and rope.base != theta:
            rope.base = float(theta)
