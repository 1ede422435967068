"""The tiny model: a few-layer llama, qwen2 or qwen3 with the local tokenizer.

`make_tiny_model` writes a Hugging Face model dir (safetensors, float32) with a
byte-level BPE tokenizer trained here (`yeto.testing.tokenizer`). With
``pretrain=True`` (the default) the base is first trained briefly (full weights) on
stdlib text and a *related* task (copying the words, not reversing them), so the base
knows the vocabulary and the chat format but not the fine-tuning task
(`yeto.testing.tasks`), and LoRA on the task shows real learning. What the
pretraining buys, in held-out loss, and what it costs: BENCHMARKS.md, "The tiny model".

Sizes (``size=``, `MODEL_SIZES`): ``tiny`` (the default: 2 layers, hidden 128) and
``small`` (4 layers, hidden 256: over 2M parameters, for checking that a result holds
as the model grows); both with the same tokenizer, vocabulary and pretraining data, each
with its own pretraining recipe (`PRETRAIN_OF`).
`parameter_count` says how many parameters a size has without building weights.

Built models are cached under ``$YETO_CACHE/tiny-models/<key>`` (default
``~/.cache/yeto``), keyed by everything that changes the weights, so a machine builds
each base once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from yeto.data import BatchSampler, encode_row, pack_blocks
from yeto.io import atomic_save, cache_home
from yeto.testing.tasks import copy_row, random_words
from yeto.testing.tokenizer import (
    generation_config,
    local_tokenizer,
    save_tokenizer,
    stdlib_text,
)

logger = logging.getLogger(__name__)

# Bump when anything about the built model changes, so stale caches are not reused.
FIXTURE_VERSION = 1

ARCHS = ("llama", "qwen2", "qwen3")

# Model shape shared by every arch. 4 query heads over 2 KV heads exercises GQA.
SIZES = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 1024,
}
# The named sizes: the same tokenizer and vocabulary, wider and deeper. "tiny" is SIZES,
# so its cache key (and every model cached before sizes existed) is unchanged.
MODEL_SIZES = {
    "tiny": SIZES,
    "small": {**SIZES, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 4},
}
DEFAULT_SIZE = "tiny"
ROPE_THETA = 10000.0

# Pretraining recipe (full weights, AdamW); part of the cache key.
PRETRAIN = {"steps": 300, "batch_size": 16, "seq_len": 128, "lr": 3e-3, "warmup": 20}
# per size (the recipe is in the cache key); "small" at PRETRAIN's lr ended worse on
# held-out text than at a lower one (docs/benchmarks-history.md, "One outer rule for both regimes")
PRETRAIN_OF = {"tiny": PRETRAIN, "small": {**PRETRAIN, "steps": 600, "lr": 1e-3}}


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Where built models live: ``<cache_dir or $YETO_CACHE or ~/.cache/yeto>/tiny-models``."""
    return Path(cache_dir or cache_home()) / "tiny-models"


def shape_of(size: str) -> dict[str, int]:
    """The model shape of a named size; a clear error for an unknown name."""
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; choose one of "
                         f"{', '.join(MODEL_SIZES)} (e.g. size='small')")
    return MODEL_SIZES[size]


def cache_key(arch: str, seed: int, pretrain: bool, size: str = DEFAULT_SIZE) -> str:
    # the shape itself is in the key (not the size's name), so "tiny" keeps the key it
    # had before sizes existed
    shape = shape_of(size)  # first: an unknown size gets its clear error
    spec = {
        "arch": arch,
        "seed": seed,
        "pretrain": PRETRAIN_OF[size] if pretrain else None,
        "sizes": shape,
        "rope_theta": ROPE_THETA,
        "version": FIXTURE_VERSION,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _config(arch: str, size: str, tokenizer: PreTrainedTokenizerFast | None) -> Any:
    """The model config of (arch, size); without a tokenizer (parameter counts), the
    size's vocabulary and no special token ids."""
    from transformers import AutoConfig

    extra: dict[str, Any] = {}
    if arch == "qwen2":
        extra["use_sliding_window"] = False
    shape = shape_of(size)
    special = ({} if tokenizer is None else
               dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id))
    return AutoConfig.for_model(
        arch,
        **{**shape, "vocab_size": shape["vocab_size"] if tokenizer is None else len(tokenizer)},
        rms_norm_eps=1e-6,
        rope_theta=ROPE_THETA,
        tie_word_embeddings=False,
        dtype="float32",
        **special,
        **extra,
    )


def parameter_count(size: str = DEFAULT_SIZE, arch: str = "llama") -> int:
    """The parameters of a built (arch, size) model, counted on the meta device: the
    real model class, no weights allocated, no tokenizer trained."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config(arch, size, None))
    return sum(p.numel() for p in model.parameters())


def _pretrain_rows(seed: int) -> list[dict]:
    # stdlib text chunks interleaved with copy-task chats (~2:1 by tokens).
    rng = random.Random(seed + 1)
    text = stdlib_text()
    chunks = [{"text": text[i : i + 2000]} for i in range(0, len(text), 2000)]
    copies = [copy_row(random_words(rng)) for _ in range(4000)]
    rows: list[dict] = []
    for i in range(max(len(chunks), len(copies))):
        rows.extend(x[i] for x in (chunks, copies) if i < len(x))
    return rows


def _pretrain(model: Any, tokenizer: Any, seed: int, cfg: dict[str, Any]) -> None:
    """Full-weight AdamW on stdlib text + the copy task (never the reverse task)."""
    import math

    import torch

    blocks = pack_blocks(
        [encode_row(r, tokenizer) for r in _pretrain_rows(seed)],
        cfg["seq_len"],
        tokenizer.pad_token_id,
    )
    sampler = BatchSampler(blocks, cfg["batch_size"], seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01)
    steps, warmup = cfg["steps"], cfg["warmup"]

    def lr_scale(s: int) -> float:  # linear warmup, then cosine down to 10%
        if s < warmup:
            return (s + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_scale)
    model.train()
    t0 = time.perf_counter()
    for step in range(steps):
        tokens, w = (torch.from_numpy(x) for x in next(sampler))
        tokens = tokens.long()
        logits = model(tokens[:, :-1]).logits
        ce = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), tokens[:, 1:], reduction="none"
        )
        loss = (ce * w).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            logger.info("pretrain step %d/%d loss %.3f", step + 1, steps, loss.item())
    model.eval()
    logger.info("pretrained %d steps in %.1fs", steps, time.perf_counter() - t0)


def _build(out_dir: Path, arch: str, seed: int, pretrain: bool, size: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    shape = shape_of(size)
    tokenizer = local_tokenizer(seed, shape["vocab_size"], shape["max_position_embeddings"])
    config = _config(arch, size, tokenizer)
    # fork_rng: seed weight init and pretraining without touching the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if pretrain:
            _pretrain(model, tokenizer, seed, PRETRAIN_OF[size])
    model.generation_config = generation_config(tokenizer)
    model.save_pretrained(str(out_dir))
    save_tokenizer(tokenizer, out_dir)
    # transformers 5 nests rope_theta under "rope_parameters"; mlx-lm's llama/qwen2
    # read only a flat "rope_theta" and silently fall back to their own defaults
    # (qwen2: 1e6), which would give wrong logits. Write both; transformers accepts it.
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rope_theta"] = ROPE_THETA
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    seed: int = 0,
    pretrain: bool = True,
    cache_dir: str | Path | None = None,
    size: str = DEFAULT_SIZE,
) -> Path:
    """Write a tiny Hugging Face model dir (safetensors, float32) and return its path.

    ``size`` names a shape of `MODEL_SIZES` ("tiny", the default, or "small").
    Built once per (arch, seed, pretrain, shape, FIXTURE_VERSION) into the cache
    (``cache_dir``, else ``$YETO_CACHE``, else ``~/.cache/yeto``), then copied.
    Building writes to a temp dir and renames it, so concurrent callers
    never see half a model.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    cached = cache_root(cache_dir) / cache_key(arch, seed, pretrain, size)
    if not (cached / "model.safetensors").is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.parent / f".tmp-{cached.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            t0 = time.perf_counter()
            _build(tmp, arch, seed, pretrain, size)
            logger.info("built %s %s model in %.1fs", size, arch, time.perf_counter() - t0)
            try:
                os.rename(tmp, cached)
            except OSError:
                if not (cached / "model.safetensors").is_file():
                    raise
                # Another process won the race with an identical model; use theirs.
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for src in sorted(cached.iterdir()):
        atomic_save(out_dir / src.name, partial(shutil.copyfile, src))
    return out_dir
