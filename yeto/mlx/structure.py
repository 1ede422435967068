"""The built mlx-lm model made to hold what the checkpoint holds: biases, the LM head.

Some mlx-lm model files hard-code choices a transformers config makes: linears with
or without a bias (gemma.py builds none where ``attention_bias=True`` adds them,
deepseek_v2.py none where ``mlp_bias=True`` does), a head tied to the embedding
(gemma.py, cohere.py always tie it; deepseek_v3.py never does). mlx-lm then refuses
the checkpoint (parameters missing or not in the model). `reconcile` runs on the
sanitized weights just before they load and changes the model, not the weights:

- a linear whose bias the checkpoint holds and the model lacks gets one (``nn.Linear``
  and ``SwitchLinear`` add ``self["bias"]`` when it is there); a linear with a bias
  the checkpoint lacks loses it;
- an untied head (``lm_head.weight``) where the model ties it: the embedding module
  gets the head as its ``as_linear`` weight (`UntiedEmbedding`), so the model's own
  ``embed_tokens.as_linear(h)`` computes ``h · headᵀ``; a head bias (``lm_head.bias``)
  there is added by ``as_linear`` (`HeadBias`);
- a tied checkpoint (no ``lm_head.weight``) where the model has a head: the head is
  loaded with the embedding matrix, as transformers ties it.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

HEADS = ("lm_head.weight", "embed_out.weight")  # gpt_neox's is embed_out
EMBEDDINGS = ("embed_tokens.weight", "embed_in.weight", "wte.weight")


class UntiedEmbedding:
    """Mixed into an embedding's own class: ``as_linear`` uses its head matrix (``head``)."""

    def as_linear(self, x):
        return x @ self["head"].T


class HeadBias:
    """Mixed into an embedding's own class: ``as_linear`` adds the head's bias
    (``head_bias``), for a head tied to the embedding that has a bias of its own."""

    def as_linear(self, x):
        return super().as_linear(x) + self["head_bias"]


_MIXED: dict[tuple[type, type], type] = {}


def _mixed(mixin: type, cls: type) -> type:
    if (mixin, cls) not in _MIXED:
        _MIXED[mixin, cls] = type(cls.__name__, (mixin, cls), {"__module__": cls.__module__})
    return _MIXED[mixin, cls]


def _module(model, path: str):
    m = model
    for part in path.split("."):
        m = m[int(part)] if isinstance(m, list) else m.get(part) if isinstance(m, dict) else None
        if m is None:
            return None
    return m


def _biases(model, weights: dict, params: dict) -> None:
    for key, value in weights.items():
        if key.endswith(".bias") and key not in params:
            m = _module(model, key[:-len(".bias")])
            if isinstance(m, nn.Module) and "weight" in m and type(m).__name__.endswith("Linear"):
                m["bias"] = mx.zeros(value.shape, dtype=m["weight"].dtype)
    for key in params:
        if key.endswith(".bias") and key not in weights and f"{key[:-5]}.weight" in weights:
            m = _module(model, key[:-len(".bias")])
            if isinstance(m, nn.Module) and type(m).__name__.endswith("Linear"):
                del m["bias"]


def _embedding_of(model, prefix: str, shape) -> str | None:
    """The path of the model's embedding under ``prefix`` whose matrix has ``shape``."""
    found = [p for p, m in model.named_modules() if p.startswith(prefix)
             and isinstance(m, nn.Embedding) and tuple(m.weight.shape) == tuple(shape)]
    # the token embedding, not a position one of the same shape (gpt2's wpe)
    found.sort(key=lambda p: not f"{p}.weight".endswith(EMBEDDINGS))
    return found[0] if found else None


def _head(model, weights: dict, params: dict) -> None:
    for key in [k for k in weights if k.endswith(HEADS) and k not in params]:
        prefix = key.rsplit(".", 2)[0] + "." if key.count(".") > 1 else ""
        if any(k.startswith(key.rsplit(".", 1)[0] + ".") for k in params):
            continue
        path = _embedding_of(model, prefix, weights[key].shape)
        if path is not None:
            emb = _module(model, path)
            if not isinstance(emb, UntiedEmbedding):  # (a replay on loaded weights: as is)
                emb.__class__ = _mixed(UntiedEmbedding, type(emb))
                emb["head"] = mx.zeros(weights[key].shape, dtype=emb.weight.dtype)
            weights[f"{path}.head"] = weights.pop(key)
    for key in [k for k in params if k.endswith(HEADS) and k not in weights]:
        shape = params[key].shape
        emb = next((k for k, v in weights.items()
                    if k.endswith(EMBEDDINGS) and tuple(v.shape) == tuple(shape)),
                   None)
        if emb is not None:
            weights[key] = weights[emb]


def _head_bias(model, weights: dict, params: dict) -> None:
    """A head bias (``lm_head.bias``) where the model computes its head with the
    embedding (tied, or untied by `_head`): added by the embedding's ``as_linear``."""
    for key in [k for k in weights if k.endswith(tuple(h[:-len("weight")] + "bias"
                                                       for h in HEADS)) and k not in params]:
        if _module(model, key.rsplit(".", 1)[0]) is not None:
            continue  # the model has the head module: `_biases` gives it the bias
        prefix = key.rsplit(".", 2)[0] + "." if key.count(".") > 1 else ""
        path = next((p for p, m in model.named_modules() if p.startswith(prefix)
                     and isinstance(m, nn.Embedding) and f"{p}.weight".endswith(EMBEDDINGS)
                     and m.weight.shape[0] == weights[key].shape[0]), None)
        if path is not None:
            emb = _module(model, path)
            if not isinstance(emb, HeadBias):
                emb.__class__ = _mixed(HeadBias, type(emb))
                emb["head_bias"] = mx.zeros(weights[key].shape, dtype=emb.weight.dtype)
            weights[f"{path}.head_bias"] = weights.pop(key)


def reconcile(model, weights: dict) -> dict:
    """The model changed to hold what ``weights`` (sanitized) holds (module docstring);
    returns ``weights`` (the head renamed where it moved into the embedding)."""
    params = dict(tree_flatten(model.parameters()))
    _head(model, weights, params)  # first: a tied head copied in may have a bias to drop
    _head_bias(model, weights, params)
    _biases(model, weights, params)
    return weights
