"""What mlx_lm/models/nanochat.py computes otherwise than transformers' NanoChat.

nanochat.py normalises with eps 1e-5 everywhere (its ``rms_norm``); transformers with
the config's ``rms_norm_eps`` (default 1e-6) (`norm_eps`). Its weight names and rotary
are translated elsewhere (`yeto.mlx.checkpoint`, `yeto.mlx.rope_files`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from yeto.mlx.rebind import rebind


def norm_eps(model, args, config: dict[str, Any]) -> None:
    """nanochat.py's classes that call ``rms_norm`` normalising with the config's
    ``rms_norm_eps``."""
    eps = config.get("rms_norm_eps")
    if eps is not None:
        rebind(model, "mlx_lm.models.nanochat",
               {"rms_norm": lambda x: mx.fast.rms_norm(x, None, eps)}, key=("nanochat", eps))
