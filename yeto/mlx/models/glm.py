"""What mlx_lm/models/glm.py builds otherwise than transformers' GLM (GLM-4).

glm.py rotates the whole head; transformers rotates the first
``partial_rotary_factor`` of it (0.5 in GLM-4 checkpoints), pairs interleaved
(`partial_rope`).
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn

from yeto.mlx.config import FULL, rope_of


def partial_rope(model, args, config: dict[str, Any]) -> None:
    """Each attention's RoPE over the config's ``partial_rotary_factor`` of the head
    (interleaved, the model's base)."""
    factor = (config.get("partial_rotary_factor")
              or rope_of(config, FULL, "partial_rotary_factor") or 1.0)
    for layer in model.layers:
        attn = layer.self_attn
        dims = int(attn.head_dim * factor)
        if dims != attn.rope.dims:
            attn.rope = nn.RoPE(dims=dims, traditional=True, base=args.rope_theta)
