"""Tiny local models and a synthetic task, built offline, for tests and demos.

`make_task` writes a chat-format "reverse the words" task; `make_tiny_model` writes
a few-layer Hugging Face model (llama, qwen2 or qwen3) with a byte-level BPE
tokenizer trained here on task text plus Python standard library source. With
``pretrain=True`` the base is first trained briefly (full weights) on stdlib text
and a *related* task (copying the words, not reversing them), so the base knows the
vocabulary and the chat format but not the fine-tuning task, and LoRA on the task
shows real learning.

Measured on 2 CPU cores (llama, seed 0), loss on assistant tokens of the 200-row
held-out split of `make_task`:

    random init            7.03 nats  (~ ln 1024: knows nothing)
    pretrained base        2.45 nats  (knows words + format; predicts a copy)
    + LoRA r=8, 300 steps  1.07 nats  (lr 2e-3, batch 16 x 128 tokens, ~30 s)

Pretraining takes ~25 s (300 AdamW steps) on an idle machine; the whole build is
then cached. qwen2 and qwen3 give similar numbers.

Built models are cached under ``$YETO_CACHE/tiny-models/<key>`` (default
``~/.cache/yeto``), keyed by everything that changes the weights.

`make_shaped_model` (``yeto make-tiny-model DIR --shape NAME``) writes instead a
random-weight float32 model with the exact configuration of a real small model
(`SHAPES`: LFM2.5-230M-like, Qwen3-0.6B, Llama-3.2-1B, SmolLM2-135M) and a local
tokenizer, for parity at real dimensions and for memory and speed benchmarks. The
weights are streamed to safetensors from a meta-device model: building the 1.2B
Llama takes ~16 s and under 1 GB of memory on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import shutil
import sysconfig
import time
import uuid
from collections.abc import Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from transformers import PreTrainedTokenizerFast

from yeto.data import BatchSampler, encode_row, pack_blocks
from yeto.io import atomic_save, atomic_write

logger = logging.getLogger(__name__)

# Bump when anything about the built model changes, so stale caches are not reused.
FIXTURE_VERSION = 1

PAD, BOS, EOS, IM_START, IM_END = "<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]

# ChatML, as used by Qwen; `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

WORDS = (
    "apple", "river", "stone", "cloud", "green", "tiger", "music", "paper", "light", "horse",
    "bread", "chair", "ocean", "plant", "smile", "train", "house", "water", "night", "dream",
)  # fmt: skip

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
ROPE_THETA = 10000.0

# Pretraining recipe (full weights, AdamW); part of the cache key.
PRETRAIN = {"steps": 300, "batch_size": 16, "seq_len": 128, "lr": 3e-3, "warmup": 20}


# ---------------------------------------------------------------- tokenizer


def stdlib_text(max_chars: int = 400_000) -> str:
    """Python standard library source, read in a fixed order, up to ``max_chars``.

    Real text gives the tokenizer a real vocabulary and the base model something
    generic to pretrain on, without any download.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        size += len(text)
        if size >= max_chars:
            break
    if not parts:
        logger.warning("no stdlib source found under %s; using task text only", root)
    return "".join(parts)[:max_chars]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with ChatML special tokens, in seconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps offsets exact, which assistant-token masking relies on.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=SIZES["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> None:
    """Save tokenizer.json + tokenizer_config.json, loadable by any transformers."""
    # Keep the chat template inside tokenizer_config.json (not chat_template.jinja),
    # the layout every loader version reads.
    tokenizer.save_pretrained(str(out_dir), save_jinja_files=False)
    # transformers 5 writes the class as "TokenizersBackend", unknown to 4.x (and so
    # to older mlx-lm installs); "PreTrainedTokenizerFast" loads the same in both.
    cfg_path = Path(out_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------- task


def _words(rng: random.Random) -> list[str]:
    return [rng.choice(WORDS) for _ in range(rng.randint(3, 5))]


def reverse_row(words: Sequence[str]) -> dict:
    """The fine-tuning task: reverse the words."""
    return {
        "messages": [
            {"role": "user", "content": "reverse: " + " ".join(words)},
            {"role": "assistant", "content": " ".join(reversed(words))},
        ]
    }


def copy_row(words: Sequence[str]) -> dict:
    """The related pretraining task: copy the words (teaches format, not the task)."""
    return {
        "messages": [
            {"role": "user", "content": "copy: " + " ".join(words)},
            {"role": "assistant", "content": " ".join(words)},
        ]
    }


def task_rows(n_train: int, n_eval: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Disjoint train / held-out rows of the reverse task (no prompt in both)."""
    rng = random.Random(seed)
    n = n_train + n_eval
    # Prompts of 3-5 words over 20 words: ~3.4M possible, so uniqueness is cheap.
    if n > 100_000:
        raise ValueError(f"n_train + n_eval = {n} is too many; the task has <= 100000 rows")
    seen: dict[tuple[str, ...], None] = {}
    while len(seen) < n:
        seen.setdefault(tuple(_words(rng)))
    prompts = list(seen)
    return [reverse_row(p) for p in prompts[n_eval:]], [reverse_row(p) for p in prompts[:n_eval]]


def _write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    atomic_write(path, "".join(json.dumps(r) + "\n" for r in rows))


def make_task(
    out_dir: str | Path, n_train: int = 2000, n_eval: int = 200, seed: int = 0
) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``eval.jsonl`` of the reverse-the-words chat task.

    Example row: user "reverse: apple river stone" -> assistant "stone river apple".
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train, held_out = task_rows(n_train, n_eval, seed)
    train_path, eval_path = out_dir / "train.jsonl", out_dir / "eval.jsonl"
    _write_jsonl(train_path, train)
    _write_jsonl(eval_path, held_out)
    return train_path, eval_path


# ---------------------------------------------------------------- model


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Where built models live: ``<cache_dir or $YETO_CACHE or ~/.cache/yeto>/tiny-models``."""
    base = cache_dir or os.environ.get("YETO_CACHE") or Path.home() / ".cache" / "yeto"
    return Path(base) / "tiny-models"


def cache_key(arch: str, seed: int, pretrain: bool) -> str:
    spec = {
        "arch": arch,
        "seed": seed,
        "pretrain": PRETRAIN if pretrain else None,
        "sizes": SIZES,
        "rope_theta": ROPE_THETA,
        "version": FIXTURE_VERSION,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _config(arch: str, tokenizer: PreTrainedTokenizerFast) -> Any:
    from transformers import AutoConfig

    extra: dict[str, Any] = {}
    if arch == "qwen2":
        extra["use_sliding_window"] = False
    return AutoConfig.for_model(
        arch,
        **{**SIZES, "vocab_size": len(tokenizer)},
        rms_norm_eps=1e-6,
        rope_theta=ROPE_THETA,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **extra,
    )


def _pretrain_rows(seed: int) -> list[dict]:
    # stdlib text chunks interleaved with copy-task chats (~2:1 by tokens).
    rng = random.Random(seed + 1)
    text = stdlib_text()
    chunks = [{"text": text[i : i + 2000]} for i in range(0, len(text), 2000)]
    copies = [copy_row(_words(rng)) for _ in range(4000)]
    rows: list[dict] = []
    for i in range(max(len(chunks), len(copies))):
        rows.extend(x[i] for x in (chunks, copies) if i < len(x))
    return rows


def task_loss(model: Any, tokenizer: Any, rows: Sequence[dict], seq_len: int = 128) -> float:
    """Token-weighted mean cross-entropy of a torch causal LM on ``rows``."""
    import torch

    blocks = pack_blocks([encode_row(r, tokenizer) for r in rows], seq_len, tokenizer.pad_token_id)
    total, count = 0.0, 0.0
    with torch.no_grad():
        for i in range(0, len(blocks), 32):
            tokens = torch.from_numpy(blocks.tokens[i : i + 32]).long()
            w = torch.from_numpy(blocks.weights[i : i + 32])
            logits = model(tokens[:, :-1]).logits.float()
            ce = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), tokens[:, 1:], reduction="none"
            )
            total += float((ce * w).sum())
            count += float(w.sum())
    return total / max(count, 1.0)


def _pretrain(model: Any, tokenizer: Any, seed: int) -> None:
    """Full-weight AdamW on stdlib text + the copy task (never the reverse task)."""
    import math

    import torch

    cfg = PRETRAIN
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


def _build(out_dir: Path, arch: str, seed: int, pretrain: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    rng = random.Random(seed)
    rows = [(copy_row if rng.random() < 0.5 else reverse_row)(_words(rng)) for _ in range(2000)]
    task_text = [m["content"] + "\n" for r in rows for m in r["messages"]]
    tokenizer = train_tokenizer([stdlib_text(), *task_text], vocab_size=SIZES["vocab_size"])
    config = _config(arch, tokenizer)
    # fork_rng: seed weight init and pretraining without touching the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if pretrain:
            _pretrain(model, tokenizer, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=tokenizer.pad_token_id,
    )
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
) -> Path:
    """Write a tiny Hugging Face model dir (safetensors, float32) and return its path.

    Built once per (arch, seed, pretrain, sizes, FIXTURE_VERSION) into the cache
    (``cache_dir``, else ``$YETO_CACHE``, else ``~/.cache/yeto``), then copied.
    Building writes to a temp dir and renames it, so concurrent callers
    never see half a model.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    cached = cache_root(cache_dir) / cache_key(arch, seed, pretrain)
    if not (cached / "model.safetensors").is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.parent / f".tmp-{cached.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            t0 = time.perf_counter()
            _build(tmp, arch, seed, pretrain)
            logger.info("built tiny %s model in %.1fs", arch, time.perf_counter() - t0)
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


# ---------------------------------------------------------------- real-shape presets

# Random-weight models with the exact architecture configuration of common small
# models, for parity at real dimensions and for memory and speed benchmarks. Each
# entry: the transformers model type, the config keyword arguments (written through
# transformers' own config class), the published model it copies and its published
# size, and `params`, this build's exact parameter count (tied embeddings counted
# once; tests/test_fixtures.py recomputes it on the meta device).
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
    from transformers import GenerationConfig

    _shape(shape)  # an unknown name fails before anything is written
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rng = random.Random(seed)
    rows = [(copy_row if rng.random() < 0.5 else reverse_row)(_words(rng)) for _ in range(2000)]
    task_text = [m["content"] + "\n" for r in rows for m in r["messages"]]
    tokenizer = train_tokenizer([stdlib_text(), *task_text], vocab_size=SHAPE_TOKENIZER_VOCAB)
    config = shape_config(shape, tokenizer)
    tokenizer.model_max_length = config.max_position_embeddings
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, the model only "
                         f"{config.vocab_size}")
    config.save_pretrained(str(out_dir))
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(str(out_dir))
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


# ---------------------------------------------------------------- CLI


def main_make_tiny_model(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="yeto make-tiny-model",
        description="Build a tiny local causal LM (2 layers, hidden 128, ~1k-token BPE\n"
        "tokenizer with a ChatML template) as a Hugging Face model dir. No network.\n"
        "Cached under $YETO_CACHE (default ~/.cache/yeto).\n\n"
        "With --shape, write instead a random-weight model with the exact configuration\n"
        "of a real small model (float32, not cached) and a local 4k-token tokenizer, for\n"
        "parity at real dimensions and memory/speed benchmarks.",
        epilog="shapes (--shape NAME):\n" + shape_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dir", type=Path, help="output model directory")
    p.add_argument("--arch", choices=ARCHS, default=None, help="architecture (default llama)")
    p.add_argument("--shape", choices=list(SHAPES), default=None, metavar="NAME",
                   help="real-shape preset, random weights: "
                   + ", ".join(f"{k} ({v.params / 1e6:.0f}M)" for k, v in SHAPES.items()))
    p.add_argument("--config-only", action="store_true",
                   help="with --shape: write config, generation config and tokenizer, no weights")
    p.add_argument("--seed", type=int, default=0, help="seed for tokenizer data and weights")
    p.add_argument(
        "--no-pretrain",
        dest="pretrain",
        action="store_false",
        help="skip the short pretraining and write random-init weights",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.shape is None:
        if args.config_only:
            p.error("--config-only needs --shape, e.g. --shape smollm2-135m --config-only")
        arch = args.arch or "llama"
        out = make_tiny_model(args.dir, arch=arch, seed=args.seed, pretrain=args.pretrain)
        print(f"wrote tiny {arch} model to {out}")
        return 0
    if args.arch is not None:
        p.error(f"--shape {args.shape} fixes the architecture ({SHAPES[args.shape].arch}); "
                "drop --arch")
    out = make_shaped_model(args.dir, args.shape, seed=args.seed, config_only=args.config_only)
    what = "config + tokenizer (no weights)" if args.config_only else "random-weight model"
    print(f"wrote {args.shape} {what} to {out}: {SHAPES[args.shape].arch}, "
          f"{SHAPES[args.shape].params:,} parameters")
    return 0


def main_make_task(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="yeto make-task",
        description='Write a synthetic chat fine-tuning task ("reverse: apple river stone" '
        '-> "stone river apple") as DIR/train.jsonl and DIR/eval.jsonl (disjoint prompts).',
    )
    p.add_argument("dir", type=Path, help="output directory")
    p.add_argument("--n-train", type=int, default=2000, help="training rows (default 2000)")
    p.add_argument("--n-eval", type=int, default=200, help="held-out rows (default 200)")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    args = p.parse_args(argv)
    train, held_out = make_task(args.dir, n_train=args.n_train, n_eval=args.n_eval, seed=args.seed)
    print(f"wrote {args.n_train} rows to {train} and {args.n_eval} rows to {held_out}")
    return 0
