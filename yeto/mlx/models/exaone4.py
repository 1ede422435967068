"""What mlx_lm/models/exaone4.py and exaone_moe.py compute otherwise than transformers'
EXAONE 4 and EXAONE-MoE.

transformers rotates a layer only when it is a sliding-window one or the config has no
sliding window; exaone4.py and exaone_moe.py rotate every layer when no layer is a
sliding one. `rope_where_sliding` stops the layers transformers does not rotate from
rotating.
"""

from __future__ import annotations

from typing import Any

from yeto.mlx.config import SLIDING, layer_types_of


def rope_where_sliding(model, args, config: dict[str, Any]) -> None:
    """With a sliding window in the config, only its sliding layers rotate."""
    types = layer_types_of(config)
    if types is None or config.get("sliding_window") is None:
        return
    for layer, kind in zip(model.layers, types):
        if kind != SLIDING:
            layer.self_attn.use_rope = False
