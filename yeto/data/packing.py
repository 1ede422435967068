"""Packing: encoded rows -> token blocks with per-token loss weights, and the
seeded batches both islands train on.

Backend-neutral: everything here is numpy; the torch and MLX islands consume the
same `Blocks` and the same `BatchSampler` batches (same function, same arrays), so
two islands with the same seed see the same batches. Rows come from
`yeto.data.sources` and are encoded by `yeto.data.formats`.

Rows without loss tokens (e.g. a chat with no assistant turn) are dropped with a
warning that counts them and names the first few; a source with no loss token at
all is an error (nothing would be learned).

Packing. Rows are concatenated into one token stream and cut into blocks of
``seq_len + 1`` tokens with stride ``seq_len`` (consecutive blocks share one token),
so every token but the first is a next-token target exactly once. Each block also
carries ``positions`` (int32, one per input token): the index of the token within
its document's piece in this block, 0 where a document (or the block) starts.

* ``packing="document"`` (the islands' default): documents never attend to each
  other. The islands turn positions into position ids and a block-diagonal causal
  mask (`segment_ids`, `attention_mask`), and the first token of every document is
  not a target (it would be predicted from the previous, unrelated document), so
  each document's loss equals its loss alone.
* ``packing="naive"``: positions run 0..seq_len-1 through the block, documents see
  the documents before them in the block, and a document's first token is a
  target (the classic packed fine-tuning; `pack_blocks`' default, kept for
  callers that feed tokens straight to a model).

What document packing does to held-out loss, against naive packing, on the tiny
model: BENCHMARKS.md, "Document packing". Evaluate a model the way it was trained
(the islands do: eval blocks use the training --packing).

Loss normalisation (both backends implement it, and must match): for one optimizer
step made of micro-batches b with targets t,

    loss = sum_b sum_t w[b, t] * CE[b, t]  /  sum_b sum_t w[b, t]

i.e. a token-weighted mean over all micro-batches of the step, never a mean of
per-micro-batch means. ``count_nonzero(w)`` is the step's "loss tokens" count that
islands report to the syncer.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from yeto.data.formats import DataError, Encoded, _eos_id, encode_example
from yeto.data.sources import Rows, read_source, shard_rows

__all__ = ["PACKING", "Batch", "BatchSampler", "Blocks", "attention_mask", "is_naive",
           "load_blocks", "pack_blocks", "segment_ids"]

logger = logging.getLogger(__name__)

PACKING = ("document", "naive")


@dataclass
class Blocks:
    """Packed training blocks.

    ``tokens[:, :-1]`` are inputs, ``tokens[:, 1:]`` targets, ``weights[i, t]`` is
    the loss weight of target ``tokens[i, t + 1]`` and ``positions[i, t]`` the
    position of input ``tokens[i, t]`` within its document's piece of the block (0
    at each document start; plain ``0..seq_len-1`` for naive packing and when not
    given). ``info`` holds what `load_blocks` learned (source provenance, counts).
    """

    tokens: np.ndarray  # int32 (n, seq_len + 1)
    weights: np.ndarray  # float32 (n, seq_len)
    positions: np.ndarray | None = None  # int32 (n, seq_len)
    info: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.positions is None:
            n, seq_len = self.weights.shape
            self.positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (n, seq_len))
        if self.positions.shape != self.weights.shape:
            raise DataError(f"positions {self.positions.shape} do not match weights "
                            f"{self.weights.shape}")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def __getitem__(self, idx: int | np.integer[Any] | slice | np.ndarray) -> Blocks:
        """Blocks ``idx`` (a slice or index array), positions and info kept."""
        if isinstance(idx, (int, np.integer)):
            idx = slice(int(idx), int(idx) + 1)
        return Blocks(self.tokens[idx], self.weights[idx], self.token_positions[idx], self.info)

    @property
    def token_positions(self) -> np.ndarray:
        """``positions``, never None: construction fills them in when not given."""
        if self.positions is None:
            raise DataError("Blocks.positions was set to None after construction")
        return self.positions

    @property
    def seq_len(self) -> int:
        return int(self.weights.shape[1])

    @property
    def loss_tokens(self) -> int:
        return int(np.count_nonzero(self.weights))

    @property
    def segments(self) -> np.ndarray:
        return segment_ids(self.token_positions)


def segment_ids(positions: np.ndarray) -> np.ndarray:
    """Per-token document piece ids within each block: a new id wherever position is 0."""
    positions = np.asarray(positions)
    return np.cumsum(positions == 0, axis=-1, dtype=np.int32)


def is_naive(positions: np.ndarray) -> bool:
    """True when every block is one plain causal sequence (no document boundaries)."""
    positions = np.asarray(positions)
    return bool((positions == np.arange(positions.shape[-1])).all())


def attention_mask(positions: np.ndarray) -> np.ndarray:
    """Block-diagonal causal mask, bool (n, seq_len, seq_len): ``[b, q, k]`` is True
    when query token q may attend to key token k (k <= q, same document piece). The
    MLX island builds its mask with this; the torch island computes the same on its
    device."""
    seg = segment_ids(positions)
    seq_len = seg.shape[-1]
    causal = np.tril(np.ones((seq_len, seq_len), dtype=bool))
    mask: np.ndarray = (seg[:, :, None] == seg[:, None, :]) & causal
    return mask


def pack_blocks(encoded: Sequence[Encoded], seq_len: int, pad_id: int = 0,
                packing: str = "naive") -> Blocks:
    """Concatenate encoded rows and cut them into blocks of ``seq_len + 1`` tokens.

    Blocks step by ``seq_len`` so that the last token of one block is the first
    (input-only) token of the next; the incomplete tail is dropped. If there are
    fewer tokens than one block, the single block is padded with ``pad_id`` at
    weight 0 so tiny files still train. ``packing`` is "naive" or "document" (see
    the module docstring); `load_blocks` and the islands default to "document".
    """
    if seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len}")
    if packing not in PACKING:
        raise DataError(f"packing must be one of {', '.join(PACKING)}, got {packing!r}")
    lengths = np.fromiter((len(ids) for ids, _ in encoded), dtype=np.int64)
    ids = np.fromiter((t for row_ids, _ in encoded for t in row_ids), dtype=np.int32)
    w = np.fromiter((x for _, row_w in encoded for x in row_w), dtype=np.float32)
    if ids.size != w.size or ids.size != int(lengths.sum()):
        raise DataError("encoded rows have token and weight lists of different lengths")
    if ids.size == 0:
        raise DataError("no tokens to pack; the data has no rows")
    if ids.size < seq_len + 1:
        pad = seq_len + 1 - ids.size
        ids = np.concatenate([ids, np.full(pad, pad_id, np.int32)])
        w = np.concatenate([w, np.zeros(pad, np.float32)])
        lengths = np.append(lengths, pad)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    n = (ids.size - 1) // seq_len
    rows = np.arange(n)[:, None] * seq_len
    tokens = ids[rows + np.arange(seq_len + 1)]
    if packing == "document":
        w = w.copy()
        w[starts[lengths > 0]] = 0.0  # a document's first token is never a target
        doc_start = np.repeat(starts, lengths)  # per stream token
        idx = rows + np.arange(seq_len)  # stream index of each input token
        positions = (idx - np.maximum(doc_start[idx], rows)).astype(np.int32)
    else:
        positions = None
    weights = w[rows + 1 + np.arange(seq_len)]
    return Blocks(tokens=np.ascontiguousarray(tokens), weights=np.ascontiguousarray(weights),
                  positions=None if positions is None else np.ascontiguousarray(positions))


def _encode_rows(rows: Rows, tokenizer: Any, packing: str, path: object
                 ) -> tuple[list[Encoded], Counter[str], list[str]]:
    """Encode every row; rows without a loss token are dropped (warned, counted)."""
    encoded: list[Encoded] = []
    methods: Counter[str] = Counter()
    dropped: list[str] = []
    for ex, where in zip(rows.examples, rows.where):
        ids, weights, method = encode_example(ex, tokenizer)
        trained = weights[1:] if packing == "document" else weights
        if not any(trained):
            dropped.append(where)
            continue
        encoded.append((ids, weights))
        methods[method] += 1
    if dropped:
        logger.warning(
            "%d of %d rows have no loss tokens and are skipped (e.g. %s); chat rows need an "
            "assistant turn, prompt/completion rows a completion", len(dropped), len(rows),
            "; ".join(dropped[:3]))
    if not encoded:
        raise DataError(
            f"{path}: no row has a loss token (all {len(rows)} rows, e.g. {dropped[0]}), so "
            "nothing would be learned; chat rows need assistant turns, prompt/completion rows "
            "a non-empty completion")
    return encoded, methods, dropped


def load_blocks(
    path: str | Path | Rows, tokenizer: Any, seq_len: int, shard: tuple[int, int] = (0, 1), *,
    packing: str = "document", revision: str | None = None, split: str | None = None,
    held_out: bool = False,
) -> Blocks:
    """Read, shard, encode and pack one data source (or already read `Rows`).

    ``blocks.info`` holds the source's provenance record (``info["source"]``) and the
    counts `yeto data` prints: format, rows, tokens, loss tokens, dropped rows and
    the loss-mask methods used.
    """
    if packing not in PACKING:
        raise DataError(f"packing must be one of {', '.join(PACKING)}, got {packing!r}")
    if isinstance(path, Rows):
        src, path = path, path.source["id"]
    else:
        src = read_source(path, revision=revision, split=split, held_out=held_out)
    rows = src.take(shard_rows(range(len(src)), *shard))
    if not len(rows):
        raise DataError(
            f"{path}: shard {shard[0]}/{shard[1]} is empty; the source has fewer rows than "
            "islands. Add rows or run fewer islands")
    encoded, methods, dropped = _encode_rows(rows, tokenizer, packing, path)
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = _eos_id(tokenizer)
    blocks = pack_blocks(encoded, seq_len, pad_id=pad_id, packing=packing)
    blocks.info = {
        "source": src.source, "format": src.format, "rows": len(encoded),
        "rows_read": len(rows), "rows_dropped": len(dropped), "dropped": dropped[:20],
        "tokens": sum(len(ids) for ids, _ in encoded),
        "loss_tokens_in_rows": int(sum(np.count_nonzero(w[1:] if packing == "document" else w)
                                       for _, w in encoded)),
        "loss_tokens": blocks.loss_tokens, "blocks": len(blocks), "packing": packing,
        "seq_len": seq_len, "loss_mask": dict(methods), "shard": list(shard),
    }
    logger.info("%s shard %d/%d: %s, %d rows -> %d blocks, %d loss tokens (%s packing)", path,
                shard[0], shard[1], src.format, len(encoded), len(blocks), blocks.loss_tokens,
                packing)
    return blocks


# ---------------------------------------------------------------- batching


class Batch(tuple[np.ndarray, np.ndarray]):
    """One batch: unpacks as ``(tokens, weights)``, the pair the islands always took;
    ``.positions`` (int32 (b, seq_len)) carries the document structure on top."""

    positions: np.ndarray

    def __new__(cls, tokens: np.ndarray, weights: np.ndarray, positions: np.ndarray) -> Batch:
        self = super().__new__(cls, (tokens, weights))
        self.positions = positions
        return self

    @property
    def tokens(self) -> np.ndarray:
        return self[0]

    @property
    def weights(self) -> np.ndarray:
        return self[1]


class BatchSampler:
    """Endless, seeded batches of blocks: `Batch` = ``(tokens, weights)`` numpy arrays
    with ``.positions``.

    Each epoch is a fresh permutation from ``np.random.default_rng(seed)``; epochs
    are chained so every batch is full even when there are fewer blocks than
    ``batch_size``. Same seed and blocks -> same batches on every machine.
    """

    def __init__(self, blocks: Blocks, batch_size: int, seed: int = 0):
        if batch_size < 1:
            raise DataError(f"batch_size must be >= 1, got {batch_size}")
        if len(blocks) == 0:
            raise DataError("cannot sample batches from zero blocks")
        self.blocks = blocks
        self.batch_size = batch_size
        self.rng = np.random.default_rng(seed)
        self.epoch = 0
        self._queue = np.empty(0, dtype=np.int64)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        while self._queue.size < self.batch_size:
            self._queue = np.concatenate([self._queue, self.rng.permutation(len(self.blocks))])
            self.epoch += 1
        idx, self._queue = self._queue[: self.batch_size], self._queue[self.batch_size :]
        b = self.blocks
        return Batch(b.tokens[idx], b.weights[idx], np.ascontiguousarray(b.token_positions[idx]))
