"""What mlx_lm/models/jamba.py computes otherwise than transformers' Jamba.

jamba.py weights the chosen experts by a softmax over the chosen router logits
(renormalised); transformers by the softmax over all experts, unnormalised
(`router_weights`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from yeto.mlx.rebind import Namespace, rebind


def router_weights(model, args, config: dict[str, Any]) -> None:
    """jamba.py's router computing transformers' weights: the chosen logits become
    log-probabilities over all experts, and their exp the weights."""

    def chosen(gates, inds, axis=-1):
        return mx.take_along_axis(gates - mx.logsumexp(gates, axis=-1, keepdims=True), inds,
                                  axis=axis)

    rebind(model, "mlx_lm.models.jamba",
           {"mx": Namespace(mx, {"take_along_axis": chosen,
                                 "softmax": lambda x, axis=-1, precise=False: mx.exp(x)})},
           key="jamba-router")
