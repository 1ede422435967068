"""The latent norms of multi-head latent attention (MLA) as transformers computes them.

transformers' MLA models normalise their latents (``q_a_layernorm``,
``kv_a_layernorm``) with its RMSNorm's default eps 1e-6; some mlx-lm files use
another: ``nn.RMSNorm``'s default 1e-5 (longcat_flash.py, minicpm3.py) or the config's
``rms_norm_eps`` (kimi_linear.py, glm4_moe_lite.py). `latent_norm_eps` sets 1e-6; it
runs after layers are built again (`yeto.mlx.layer_kinds`), so that rebuilt layers
get it too.
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn

#: model types whose mlx-lm file normalises the MLA latents with another eps than
#: transformers' `EPS`
TYPES = {"longcat_flash", "minicpm3", "kimi_linear", "glm4_moe_lite"}
EPS = 1e-6


def latent_norm_eps(model, config: dict[str, Any]) -> list[str]:
    """Every MLA latent norm of a `TYPES` model with eps `EPS`; returns what was set."""
    if config.get("model_type") not in TYPES:
        return []
    done = []
    for path, module in model.named_modules():
        for name in ("q_a_layernorm", "kv_a_layernorm"):
            norm = module.get(name) if isinstance(module, dict) else None
            if isinstance(norm, nn.RMSNorm) and norm.eps != EPS:
                norm.eps = EPS
                done.append(f"{path}.{name}: eps {EPS}")
    return done
