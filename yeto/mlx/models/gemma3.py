"""What mlx_lm/models/gemma3_text.py (also inside gemma3.py) computes otherwise than
transformers' Gemma 3.

gemma3_text.py rounds the embedding scale sqrt(hidden_size) to bfloat16 (as Gemma's
own code does); transformers computes it in the model's dtype, 1e-3 apart where
bfloat16 cannot hold the root (hidden 48, 96). `embedding_scale` rounds it to the
model's dtype instead (float32: exact; a bfloat16 model: as mlx-lm rounds it).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from yeto.mlx.rebind import Namespace, rebind


def embedding_scale(model, args, config: dict[str, Any]) -> None:
    """gemma3_text.py's classes that scale the embedding by sqrt(hidden_size) rounded
    to bfloat16 rounding it to the hidden states' dtype instead."""
    rebind(model, "mlx_lm.models.gemma3_text",
           {"mx": Namespace(mx, {"bfloat16": mx.float32})}, key="gemma3-scale")
