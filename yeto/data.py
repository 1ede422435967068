"""Training data: JSONL rows -> token blocks with per-token loss weights.

Backend-neutral: everything here is numpy; the torch and MLX islands consume the
same `Blocks` and the same `BatchSampler` batches, so two islands with the same
seed see the same batches.

Row schemas (one per row, extra keys are ignored):

    {"text": "..."}                                   loss on every token (+ EOS)
    {"prompt": "...", "completion": "..."}            loss on completion tokens (+ EOS)
    {"messages": [{"role": ..., "content": ...}]}     rendered with the chat template;
                                                      loss on assistant turns only,
                                                      including their end-of-turn token

Rows are concatenated into one token stream and cut into blocks of ``seq_len + 1``
tokens with stride ``seq_len`` (consecutive blocks share one token), so every token
but the first is a next-token target exactly once. Rows are not isolated from each
other inside a block (no document masking), as in most packed fine-tuning.

Loss normalisation (both backends implement it, and must match): for one optimizer
step made of micro-batches b with targets t,

    loss = sum_b sum_t w[b, t] * CE[b, t]  /  sum_b sum_t w[b, t]

i.e. a token-weighted mean over all micro-batches of the step, never a mean of
per-micro-batch means. ``sum(w)`` is the step's "loss tokens" count that islands
report to the syncer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

ACCEPTED_SCHEMAS = (
    '{"text": ...}, {"messages": [{"role": ..., "content": ...}, ...]}, '
    '{"prompt": ..., "completion": ...}'
)

Encoded = tuple[list[int], list[float]]


class DataError(ValueError):
    """Training data that cannot be used, with a message saying where and why."""


# ---------------------------------------------------------------- reading rows


def row_schema(row: Any, where: str = "row") -> str:
    """Return "text", "messages" or "prompt_completion", or raise DataError."""
    if not isinstance(row, dict):
        raise DataError(
            f"{where}: expected a JSON object, got {type(row).__name__}; "
            f"accepted: {ACCEPTED_SCHEMAS}"
        )
    found = [
        name
        for name, keys in (
            ("text", ("text",)),
            ("messages", ("messages",)),
            ("prompt_completion", ("prompt", "completion")),
        )
        if all(k in row for k in keys)
    ]
    if not found:
        raise DataError(
            f"{where}: unknown row schema with keys {sorted(row)}; accepted: {ACCEPTED_SCHEMAS}"
        )
    if len(found) > 1:
        raise DataError(
            f"{where}: ambiguous row, it matches several schemas ({', '.join(found)}); "
            "keep only one of them per row"
        )
    schema = found[0]
    if schema == "text" and not isinstance(row["text"], str):
        raise DataError(f'{where}: "text" must be a string, got {type(row["text"]).__name__}')
    if schema == "prompt_completion":
        for k in ("prompt", "completion"):
            if not isinstance(row[k], str):
                raise DataError(f'{where}: "{k}" must be a string, got {type(row[k]).__name__}')
    if schema == "messages":
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f'{where}: "messages" must be a non-empty list of {{role, content}}')
        for i, m in enumerate(msgs):
            if not (
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
            ):
                raise DataError(
                    f'{where}: messages[{i}] must be {{"role": str, "content": str}}, got {m!r:.80}'
                )
    return schema


def load_rows(path: str | Path) -> list[dict]:
    """Read training rows from a ``.jsonl`` file (or a ``.json`` list of rows)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path} (pass the path of a .jsonl file)")
    if path.suffix not in (".jsonl", ".json"):
        raise DataError(
            f"{path}: unsupported file type {path.suffix!r}; use .jsonl (one JSON row per "
            "line) or .json (a list of rows)"
        )
    text = path.read_text(encoding="utf-8")
    rows: list[dict] = []
    if path.suffix == ".json":
        try:
            data = json.loads(text) if text.strip() else []
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {e.lineno}: invalid JSON ({e.msg})") from None
        if not isinstance(data, list):
            raise DataError(f"{path}: a .json data file must hold a list of rows")
        for i, row in enumerate(data, 1):
            row_schema(row, f"{path} row {i}")
            rows.append(row)
    else:
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path} line {lineno}: invalid JSON ({e.msg} at column {e.colno}); "
                    "each line must hold one JSON object"
                ) from None
            row_schema(row, f"{path} line {lineno}")
            rows.append(row)
    if not rows:
        raise DataError(f"{path}: no rows found; the file is empty")
    return rows


def shard_rows(rows: Sequence[dict], index: int, count: int) -> list[dict]:
    """Rows of island ``index`` out of ``count``: row i goes to island i mod count."""
    if count < 1 or not 0 <= index < count:
        raise DataError(f"bad shard {index}/{count}: need count >= 1 and 0 <= index < count")
    return list(rows[index::count])


# ---------------------------------------------------------------- encoding


def _eos_id(tokenizer: Any) -> int:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no eos_token; set tokenizer.eos_token before encoding")
    return int(eos)


def _weights_from_spans(
    offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> list[float]:
    # A token counts when its character span overlaps a weighted span; zero-width
    # tokens (special tokens added by the tokenizer) never do.
    return [1.0 if any(s < hi and e > lo for lo, hi in spans) else 0.0 for s, e in offsets]


def _assistant_spans(messages: list[dict], tokenizer: Any) -> tuple[str, list[tuple[int, int]]]:
    """Render a chat and find the character span of each assistant turn.

    Renders the conversation prefix by prefix instead of relying on
    ``{% generation %}`` markers, which most chat templates lack. A turn's span runs
    from the end of the prefix render (with the generation prompt, so the
    "assistant" header is excluded) to the end of the render that includes the turn,
    minus trailing whitespace, so the end-of-turn token is in and the newline after
    it is out.
    """

    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            '"messages" rows need a tokenizer with a chat template, and this one has none; '
            "use a chat model's tokenizer, set tokenizer.chat_template, or write "
            "prompt/completion rows instead"
        )

    def render(msgs: list[dict], gen: bool = False) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    full = render(messages)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = None
        for gen in (True, False):  # some templates render no generation prompt
            before = render(messages[:k], gen) if k else ""
            if full.startswith(before):
                start = len(before)
                break
        upto = render(messages[: k + 1])
        if start is None or not full.startswith(upto):
            raise DataError(
                "the chat template does not render conversations prefix by prefix "
                f"(the render up to message {k} is not a prefix of the full render), so "
                "assistant turns cannot be located; templates that rewrite earlier turns "
                "(e.g. stripping reasoning) do this. Use prompt/completion rows instead, or "
                "a chat template without that rewriting"
            )
        end = len(upto.rstrip())
        if end > start:
            spans.append((start, end))
    return full, spans


def encode_row(row: dict, tokenizer: Any) -> Encoded:
    """Token ids and per-token loss weights (1.0 = counts in the loss) of one row."""
    schema = row_schema(row)
    eos = _eos_id(tokenizer)
    if schema == "text":
        ids = tokenizer(row["text"], add_special_tokens=True, verbose=False)["input_ids"]
        if not ids or ids[-1] != eos:
            ids = [*ids, eos]
        weights = [1.0] * len(ids)
    elif schema == "prompt_completion":
        # Tokenize as one string so the boundary tokenizes as it will at inference.
        prompt = row["prompt"]
        enc = tokenizer(
            prompt + row["completion"],
            add_special_tokens=True,
            return_offsets_mapping=True,
            verbose=False,  # long rows are fine: they are packed, not fed whole
        )
        ids = list(enc["input_ids"])
        weights = _weights_from_spans(enc["offset_mapping"], [(len(prompt), 1 << 62)])
        if not ids or ids[-1] != eos:
            ids.append(eos)
            weights.append(1.0)
    else:
        text, spans = _assistant_spans(row["messages"], tokenizer)
        # The template already holds any BOS / special tokens it wants.
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        ids = list(enc["input_ids"])
        weights = _weights_from_spans(enc["offset_mapping"], spans)
    if not any(weights):
        logger.debug("row has no loss tokens (schema %s, %d tokens)", schema, len(ids))
    return ids, weights


# ---------------------------------------------------------------- packing


@dataclass
class Blocks:
    """Packed training blocks.

    ``tokens[:, :-1]`` are inputs, ``tokens[:, 1:]`` targets, and ``weights[i, t]``
    is the loss weight of target ``tokens[i, t + 1]``.
    """

    tokens: np.ndarray  # int32 (n, seq_len + 1)
    weights: np.ndarray  # float32 (n, seq_len)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.weights.shape[1])

    @property
    def loss_tokens(self) -> int:
        return int(np.count_nonzero(self.weights))


def pack_blocks(encoded: Sequence[Encoded], seq_len: int, pad_id: int = 0) -> Blocks:
    """Concatenate encoded rows and cut them into blocks of ``seq_len + 1`` tokens.

    Blocks step by ``seq_len`` so that the last token of one block is the first
    (input-only) token of the next; the incomplete tail is dropped. If there are
    fewer tokens than one block, the single block is padded with ``pad_id`` at
    weight 0 so tiny files still train.
    """
    if seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len}")
    ids = np.fromiter((t for row_ids, _ in encoded for t in row_ids), dtype=np.int32)
    w = np.fromiter((x for _, row_w in encoded for x in row_w), dtype=np.float32)
    if ids.size != w.size:
        raise DataError("encoded rows have token and weight lists of different lengths")
    if ids.size == 0:
        raise DataError("no tokens to pack; the data has no rows")
    if ids.size < seq_len + 1:
        pad = seq_len + 1 - ids.size
        ids = np.concatenate([ids, np.full(pad, pad_id, np.int32)])
        w = np.concatenate([w, np.zeros(pad, np.float32)])
    n = (ids.size - 1) // seq_len
    starts = np.arange(n)[:, None] * seq_len
    tokens = ids[starts + np.arange(seq_len + 1)]
    weights = w[starts + 1 + np.arange(seq_len)]
    return Blocks(tokens=np.ascontiguousarray(tokens), weights=np.ascontiguousarray(weights))


def load_blocks(
    path: str | Path, tokenizer: Any, seq_len: int, shard: tuple[int, int] = (0, 1)
) -> Blocks:
    """Read, shard, encode and pack one data file."""
    rows = shard_rows(load_rows(path), *shard)
    if not rows:
        raise DataError(
            f"{path}: shard {shard[0]}/{shard[1]} is empty; the file has fewer rows than "
            "islands. Add rows or run fewer islands"
        )
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = _eos_id(tokenizer)
    blocks = pack_blocks([encode_row(r, tokenizer) for r in rows], seq_len, pad_id=pad_id)
    msg = f"{path} shard {shard[0]}/{shard[1]}: {len(rows)} rows -> {len(blocks)} blocks"
    logger.info("%s, %d loss tokens", msg, blocks.loss_tokens)
    if blocks.loss_tokens == 0:
        logger.warning(
            "%s: no loss tokens after packing; nothing will be learned. Check that rows have "
            "assistant turns / completions, or raise seq_len (the incomplete tail is dropped)",
            path,
        )
    return blocks


# ---------------------------------------------------------------- batching


class BatchSampler:
    """Endless, seeded batches of blocks: ``(tokens, weights)`` numpy arrays.

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

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        while self._queue.size < self.batch_size:
            self._queue = np.concatenate([self._queue, self.rng.permutation(len(self.blocks))])
            self.epoch += 1
        idx, self._queue = self._queue[: self.batch_size], self._queue[self.batch_size :]
        return self.blocks.tokens[idx], self.blocks.weights[idx]
