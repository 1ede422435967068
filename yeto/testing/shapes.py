"""Random-weight models with the exact configuration of a real small model.

`make_shaped_model` (``yeto make-tiny-model DIR --shape NAME``) writes a float32 model
with the configuration of one of `SHAPES` (LFM2.5-230M-like, Qwen3-0.6B, Llama-3.2-1B,
SmolLM2-135M) and the local tokenizer (`yeto.testing.tokenizer`), for parity at real
dimensions and for memory and speed benchmarks. The weights are streamed to
safetensors from a meta-device model, block by block, so building needs about one
block of memory beyond the libraries whatever the model size (what building costs:
BENCHMARKS.md, "The tiny model").
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple

from transformers import PreTrainedTokenizerFast

from yeto.testing.tokenizer import generation_config, local_tokenizer, save_tokenizer

logger = logging.getLogger(__name__)

# Random-weight models with the exact architecture configuration of common small
# models, for parity at real dimensions and for memory and speed benchmarks. Each
# entry: the transformers model type, the config keyword arguments (written through
# transformers' own config class), the published model it copies and its published
# size, and `params`, this build's exact parameter count (tied embeddings counted
# once; tests/unit/test_fixtures.py recomputes it on the meta device).
#
# lfm2.5-230m: no LFM2 config of that size was at hand, so it is derived from
# LiquidAI/LFM2-350M (hidden 1024, 16 heads over 8 KV heads, head_dim 64, conv
# L_cache 3, vocab 65536, tied embeddings, rope_theta 1e6, norm eps 1e-5, SwiGLU
# `w1/w3/w2` with block_auto_adjust_ff_dim, 16 layers with attention at
# [2, 5, 8, 10, 12, 14], 354M parameters) by making it shallower and its feed-forward narrower:
#   - 14 layers, attention at [2, 4, 6, 8, 10, 12]: LFM2's pattern (two conv
#     blocks, then attention and conv alternating, a conv block last) with one conv
#     block fewer in each of the first two runs: 6 attention + 8 conv blocks.
#     LoRA on every linear of the blocks (all-linear, what `auto` means for dense
#     models) adapts 6 x 7 (q/k/v/out_proj, w1/w2/w3) + 8 x 5 (in_proj, out_proj,
#     w1/w2/w3) = 82 linears = 164 tensors, the count the design notes report for
#     LFM2.5-230M (../shared/seeds/004_94dadd76b11b2e30.txt).
#   - feed-forward 2560 (intermediate_size 3840, auto-adjusted as LFM2 does:
#     int(2 * 3840 / 3) = 2560, already a multiple of 256), which puts the total at
#     229.7M: 67.1M embedding + 8 x 12.06M conv blocks + 6 x 11.01M attention blocks.


class Shape(NamedTuple):
    arch: str  # transformers model_type
    like: str  # the published model this copies
    config: dict[str, Any]  # AutoConfig.for_model keyword arguments
    params: int  # this build's exact parameter count (tied embeddings once)
    published: int  # the published size
    source: str  # where `published` (and the dimensions) come from


SHAPES: dict[str, Shape] = {
    "lfm2.5-230m": Shape(
        arch="lfm2",
        like="LFM2.5-230M (derived from LiquidAI/LFM2-350M)",
        config=dict(
            vocab_size=65536, hidden_size=1024, intermediate_size=3840, num_hidden_layers=14,
            num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=128_000,
            layer_types=["full_attention" if i in (2, 4, 6, 8, 10, 12) else "conv"
                         for i in range(14)],
            full_attn_idxs=[2, 4, 6, 8, 10, 12], conv_L_cache=3, conv_bias=False,
            block_multiple_of=256, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True,
            norm_eps=1e-5, initializer_range=0.02, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
        params=229_693_184,
        published=230_000_000,
        source="the model name (LFM2.5-230M, in the yeto design notes)",
    ),
    "qwen3-0.6b": Shape(
        arch="qwen3",
        like="Qwen/Qwen3-0.6B",
        config=dict(
            vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128,
            max_position_embeddings=40_960, rms_norm_eps=1e-6, initializer_range=0.02,
            attention_bias=False, use_sliding_window=False, sliding_window=None,
            max_window_layers=28, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
        params=596_049_920,
        published=600_000_000,
        source="Qwen/Qwen3-0.6B model card: 0.6B parameters, 0.44B non-embedding",
    ),
    "llama3.2-1b": Shape(
        arch="llama",
        like="meta-llama/Llama-3.2-1B",
        config=dict(
            vocab_size=128_256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, head_dim=64,
            max_position_embeddings=131_072, rms_norm_eps=1e-5, initializer_range=0.02,
            attention_bias=False, mlp_bias=False, tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 500_000.0, "factor": 32.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
        params=1_235_814_400,
        published=1_230_000_000,
        source="meta-llama/Llama-3.2-1B model card: 1.23B parameters",
    ),
    "smollm2-135m": Shape(
        arch="llama",
        like="HuggingFaceTB/SmolLM2-135M",
        config=dict(
            vocab_size=49_152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, head_dim=64,
            max_position_embeddings=8192, rms_norm_eps=1e-5,
            initializer_range=0.041666666666666664, attention_bias=False, mlp_bias=False,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 100_000.0},
        ),
        params=134_515_008,
        published=135_000_000,
        source="HuggingFaceTB/SmolLM2-135M model card: 135M parameters",
    ),
}

# The presets' tokenizer: trained here like the tiny models' (ChatML specials at ids
# 0-4), smaller than the model's vocab. The model keeps the real vocab size, so
# parameter counts and memory are real; ids past the tokenizer's are never produced.
SHAPE_TOKENIZER_VOCAB = 4096


def shape_help() -> str:
    """One line per preset: name, parameter count, what it copies."""
    return "\n".join(f"  {name:<13} {s.params / 1e6:7.1f}M  {s.arch:<6} like {s.like}"
                     for name, s in SHAPES.items())


def _shape(shape: str) -> Shape:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    return SHAPES[shape]


def shape_config(shape: str, tokenizer: PreTrainedTokenizerFast | None = None) -> Any:
    """The transformers config of a preset. With a tokenizer, its special-token ids
    (which lie inside the model's vocab) replace the original model's."""
    from transformers import AutoConfig

    s = _shape(shape)
    ids: dict[str, Any] = {}
    if tokenizer is not None:
        ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id}
    return AutoConfig.for_model(s.arch, **s.config, **ids, dtype="float32")


def meta_model(config: Any) -> Any:
    """The causal LM of ``config`` on the meta device: shapes, no memory."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def count_params(model: Any) -> int:
    """Parameters, each shared (tied) tensor counted once."""
    return sum(p.numel() for p in model.parameters())


def _saved_tensors(model: Any) -> list[tuple[str, Any]]:
    """(name, meta tensor) as `save_pretrained` writes them: the state dict with each
    tied tensor under its first name only (``lm_head.weight`` drops out when tied)."""
    out, seen = [], set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def _init_chunks(name: str, meta: Any, seed: int, std: float, chunk: int = 1 << 26) -> Any:
    """Random init for one tensor, in row blocks of at most ``chunk`` elements (a
    128256 x 2048 embedding is 1 GB in float32; its blocks are 256 MB). Seeded by
    (seed, name), so it does not depend on the order of writing: normal(0, std) for
    matrices (and conv kernels), ones for norm weights, zeros for biases."""
    import torch

    if meta.ndim == 1:
        yield torch.full(meta.shape, 1.0 if "norm" in name else 0.0, dtype=torch.float32)
        return
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    row = meta[0].numel()
    step = max(1, chunk // row)
    for start in range(0, meta.shape[0], step):
        rows = min(step, meta.shape[0] - start)
        yield torch.empty((rows, *meta.shape[1:]), dtype=torch.float32).normal_(
            0.0, std, generator=gen)


def _write_safetensors(path: Path, tensors: list[tuple[str, Any]], chunks: Any) -> None:
    """Stream a float32 safetensors file block by block, so peak memory is one block,
    not the model. ``chunks(name, meta)`` yields the tensor's row blocks in order.

    The format (github.com/huggingface/safetensors): an 8-byte little-endian header
    length, a JSON header {name: {dtype, shape, data_offsets}} padded with spaces to
    8 bytes, then the raw little-endian tensor bytes in header order."""
    import struct

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors:
        size = t.numel() * 4
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    total, done, next_report, t0 = offset, 0, 0.1, time.perf_counter()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, meta in tensors:
            written = 0
            for block in chunks(name, meta):
                block.numpy().tofile(f)
                written += block.numel()
            if written != meta.numel():  # never expected: the header would be wrong
                raise RuntimeError(f"{name}: wrote {written} of {meta.numel()} elements")
            done += written * 4
            if done / total >= next_report or done == total:
                logger.info("  weights %5.1f%%  %.2f / %.2f GB  %.0fs", 100 * done / total,
                            done / 1e9, total / 1e9, time.perf_counter() - t0)
                next_report = done / total + 0.1
        f.flush()
        os.fsync(f.fileno())


def make_shaped_model(
    out_dir: str | Path, shape: str, seed: int = 0, config_only: bool = False
) -> Path:
    """Write a random-weight model with the configuration of a real small model.

    ``shape`` is a key of `SHAPES`. Writes ``config.json`` (by transformers' config
    class), ``generation_config.json``, a locally trained tokenizer and, unless
    ``config_only``, ``model.safetensors`` (float32, seeded random init). The
    weights are streamed in blocks of at most 256 MB from a meta-device model, so
    building needs about that beyond the libraries, whatever the model size.
    Not cached: a 1B model is 5 GB.
    """
    _shape(shape)  # an unknown name fails before anything is written
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tokenizer = local_tokenizer(seed, SHAPE_TOKENIZER_VOCAB)
    config = shape_config(shape, tokenizer)
    tokenizer.model_max_length = config.max_position_embeddings
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, the model only "
                         f"{config.vocab_size}")
    config.save_pretrained(str(out_dir))
    generation_config(tokenizer).save_pretrained(str(out_dir))
    save_tokenizer(tokenizer, out_dir)
    model = meta_model(config)
    n = count_params(model)
    if config_only:
        logger.info("wrote %s config + tokenizer (%d parameters, no weights) to %s",
                    shape, n, out_dir)
        return out_dir
    tensors = _saved_tensors(model)
    logger.info("writing %s: %d tensors, %d parameters, %.2f GB float32", shape, len(tensors),
                n, sum(t.numel() for _, t in tensors) * 4 / 1e9)
    std = config.initializer_range
    final = out_dir / "model.safetensors"
    tmp = out_dir / f".model.safetensors.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _write_safetensors(tmp, tensors, lambda name, meta: _init_chunks(name, meta, seed, std))
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    logger.info("built %s (%d parameters) in %.1fs", shape, n, time.perf_counter() - t0)
    return out_dir
