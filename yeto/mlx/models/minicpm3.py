"""What mlx_lm/models/minicpm3.py builds otherwise than transformers' MiniCPM3.

- Value width: transformers reads ``v_head_dim`` from the config (``hidden_size //
  num_attention_heads`` only when unset); mlx-lm always takes ``hidden_size //
  num_attention_heads``, so ``kv_b_proj`` and ``o_proj`` have the wrong shape wherever
  the two differ (the weights then fail to load). Its attention splits the values off
  ``kv_b_proj``'s output and reshapes its output to whatever width that gives, so new
  projections of the config's width are all it takes (`fit_values`).
- Tied head: transformers divides the last hidden state by ``hidden_size /
  dim_model_base`` before the head, tied or not; mlx-lm only before an untied one.
  The final norm of a tied model divides instead (`scale_tied_head`).
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn


def fit_values(model, args, config: dict[str, Any]) -> list[str]:
    """Give each attention of ``model`` with ``v_head_dim``, ``kv_b_proj`` and ``o_proj``
    whose values are not the config's ``v_head_dim`` wide new projections of that width
    (same heads, biases and latent rank), before the weights load; returns the paths."""
    width = config.get("v_head_dim")
    if not isinstance(width, int):
        return []
    done = []
    for path, attn in model.named_modules():
        kv_b, out = getattr(attn, "kv_b_proj", None), getattr(attn, "o_proj", None)
        if not (isinstance(getattr(attn, "v_head_dim", None), int)
                and isinstance(kv_b, nn.Linear) and isinstance(out, nn.Linear)) \
                or attn.v_head_dim == width:
            continue
        heads, nope = attn.num_heads, attn.qk_nope_head_dim
        attn.kv_b_proj = nn.Linear(kv_b.weight.shape[1], heads * (nope + width),
                                   bias="bias" in kv_b)
        attn.o_proj = nn.Linear(heads * width, out.weight.shape[0], bias="bias" in out)
        attn.v_head_dim = width
        done.append(f"{path} (v_head_dim {width})")
    return done


class _DividedNorm(nn.RMSNorm):
    """An RMSNorm whose output is divided by ``_yeto_divisor`` (same parameters)."""

    def __call__(self, x):
        return super().__call__(x) / self._yeto_divisor


def scale_tied_head(model, args, config: dict[str, Any]) -> list[str]:
    """A tied model's final norm divides by ``hidden_size / dim_model_base`` (see the
    module docstring); returns the path changed."""
    if not args.tie_word_embeddings:
        return []
    norm = model.model.norm
    if type(norm) is not nn.RMSNorm:
        return []
    norm.__class__ = _DividedNorm
    norm._yeto_divisor = args.hidden_size / args.dim_model_base
    return ["model.norm (tied head: / hidden_size / dim_model_base)"]
