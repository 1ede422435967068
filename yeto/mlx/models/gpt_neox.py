"""What mlx_lm/models/gpt_neox.py builds otherwise than transformers' GPT-NeoX.

gpt_neox.py builds the MLP 4 x hidden wide (as in Pythia); transformers reads
``intermediate_size``, any width (`mlp_width`).
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn


def mlp_width(model, args, config: dict[str, Any]) -> None:
    """Each MLP's two linears ``intermediate_size`` wide (before the weights load)."""
    width = config.get("intermediate_size")
    for layer in getattr(model.model, "h", []):
        mlp = layer.mlp
        if width and mlp.dense_h_to_4h.weight.shape[0] != width:
            mlp.dense_h_to_4h = nn.Linear(args.hidden_size, width)
            mlp.dense_4h_to_h = nn.Linear(width, args.hidden_size)
