"""A tiny model of any architecture that a rollout node can serve.

`servable_model` writes `yeto.testing.archs.tiny_model`'s random weights with the
local tokenizer (`yeto.testing.tokenizer`, its vocabulary the model's) and a
generation config, so the dir loads everywhere a Hugging Face model dir does:
``python -m yeto.rollout --model DIR``, `TorchEngine`, `MLXEngine`. The rollout
tests and `scripts/bench_rollout.py --hybrid` use it for hybrid (conv / SSM +
attention) models such as LFM2.
"""

from __future__ import annotations

from pathlib import Path

from yeto.testing import archs
from yeto.testing.tokenizer import generation_config, local_tokenizer, save_tokenizer

#: the tokenizer's size: the tiny model's vocabulary
VOCAB = 1024


def servable_model(arch: str, dest: str | Path, seed: int = 0,
                   overrides: dict | None = None) -> Path:
    """Write a tiny random-weight ``arch`` model with tokenizer and generation config
    into ``dest``; returns ``dest``."""
    tok = local_tokenizer(seed, VOCAB, archs.TINY["max_position_embeddings"])
    ids = {"vocab_size": len(tok), "bos_token_id": tok.bos_token_id,
           "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    if "text_config" in archs.tiny_config(arch).to_dict():  # image-text: the text model's
        ids["text_config"] = dict(ids)
    dest = archs.tiny_model(arch, dest, seed, {**ids, **(overrides or {})})
    save_tokenizer(tok, dest)
    generation_config(tok).save_pretrained(str(dest))
    return dest
