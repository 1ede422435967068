"""Training data: rows -> packed token blocks with per-token loss weights.

Backend-neutral: everything here is numpy; the torch and MLX islands consume the
same `Blocks` and the same `BatchSampler` batches (same function, same arrays), so
two islands with the same seed see the same batches.

Sources (``load_blocks(source, ...)``, ``yeto data SOURCE``):

* a local ``.jsonl`` (one row per line), ``.json`` (a list of rows, or JSON lines)
  or ``.parquet`` file;
* a local folder of such files (searched recursively, hidden paths skipped); when
  file or folder names carry split names (``train``, ``validation``/``valid``/
  ``dev``/``val``, ``test``/``eval``, as on the Hugging Face hub) one split is
  read: ``split=`` (``--data-split``), else ``train`` for training data and
  ``validation``, then ``test``, for held-out data;
* a folder written by ``datasets``' ``save_to_disk`` (a Dataset, or a DatasetDict
  with the split chosen as above);
* a hub dataset id (``org/name``), resolved to a commit (``revision=``,
  ``--data-revision``) through the local Hugging Face cache; see yeto.data.provenance.

Row formats (text, OpenAI messages, ShareGPT, Alpaca, prompt/completion) are
detected per file and described in `yeto.data.formats`; a row of another format than
its file's first row is an error naming the file and line.

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

Measured effect (tiny llama from `yeto.cli.fixtures.make_tiny_model`, the reverse task
from `make_task`: 2000 train / 200 held-out chats; LoRA r=8, AdamW lr 2e-3, 300
steps of 16 x 128-token blocks, 2 CPU cores, seeds 0 and 1; held-out loss on
assistant tokens, each held-out chat alone, i.e. document-packed eval):

    base model                          2.463
    trained with --packing naive        1.070, 1.040   (mean 1.055)
    trained with --packing document     1.028, 0.997   (mean 1.012, -0.043 nats)

Same steps and loss tokens (9963) in both. The naive-trained model scores the
same under naive eval (1.067, 1.039); the document-trained one, never shown
foreign chats in its context, scores 2.88 / 2.90 there, so evaluate it the way it
was trained (the islands do: eval blocks use the training --packing).

Loss normalisation (both backends implement it, and must match): for one optimizer
step made of micro-batches b with targets t,

    loss = sum_b sum_t w[b, t] * CE[b, t]  /  sum_b sum_t w[b, t]

i.e. a token-weighted mean over all micro-batches of the step, never a mean of
per-micro-batch means. ``count_nonzero(w)`` is the step's "loss tokens" count that
islands report to the syncer.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from yeto.data.formats import (
    ACCEPTED_SCHEMAS,
    FORMATS,
    DataError,
    Encoded,
    Example,
    _eos_id,
    detect_format,
    encode_example,
    encode_row,
    row_schema,
    to_example,
)

__all__ = [
    "ACCEPTED_SCHEMAS", "FORMATS", "PACKING", "Batch", "BatchSampler", "Blocks", "DataError",
    "Encoded", "Rows", "attention_mask", "encode_row", "load_blocks", "load_rows",
    "pack_blocks", "read_source", "row_schema", "segment_ids", "shard_rows",
]  # fmt: skip

logger = logging.getLogger(__name__)

PACKING = ("document", "naive")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
# The hub's split naming (as in `datasets`): keyword -> canonical split.
SPLIT_KEYWORDS = {
    "train": "train", "training": "train",
    "validation": "validation", "valid": "validation", "dev": "validation", "val": "validation",
    "test": "test", "testing": "test", "eval": "test", "evaluation": "test",
}  # fmt: skip
HELD_OUT_SPLITS = ("validation", "test")


# ---------------------------------------------------------------- reading rows


@dataclass
class Rows:
    """Validated rows of one source, with where each came from and its format."""

    rows: list[dict]
    examples: list[Example]
    where: list[str]  # "FILE line N" / "FILE row N" per row
    formats: dict[str, str]  # file -> format (one per file)
    source: dict[str, Any]  # provenance: id, kind, path, revision, commit, digest, files, split

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def format(self) -> str:
        return "+".join(sorted(set(self.formats.values())))

    def take(self, idx: Sequence[int]) -> Rows:
        return Rows([self.rows[i] for i in idx], [self.examples[i] for i in idx],
                    [self.where[i] for i in idx], self.formats, self.source)


def _check_file(rows: list[dict], where: list[str], name: str) -> tuple[str, list[Example]]:
    """Detect the file's format from its first row; validate every row against it."""
    if not rows:
        raise DataError(f"{name}: no rows found; the file is empty")
    fmt = detect_format(rows[0], where[0])
    examples = []
    for row, w in zip(rows, where):
        this = detect_format(row, w)
        if this != fmt:
            raise DataError(
                f"{w}: a {this} row (keys {sorted(row)}) in a {fmt} file ({where[0]} set the "
                f"format); use one format per file: split or convert the rows. Accepted: "
                f"{ACCEPTED_SCHEMAS}")
        examples.append(to_example(row, fmt, w))
    return fmt, examples


def _drop_nulls(rows: list[dict]) -> list[dict]:
    # Columnar sources give every row every column; a null there means "absent".
    return [{k: v for k, v in r.items() if v is not None} for r in rows]


def _read_json_file(path: Path, name: str) -> tuple[list[Any], list[str]]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            data = json.loads(text) if text.strip() else []
        except json.JSONDecodeError as e:
            if e.msg != "Extra data":
                raise DataError(f"{name} line {e.lineno}: invalid JSON ({e.msg})") from None
            data = None  # more than one value: JSON lines in a .json file
        if data is not None:
            if not isinstance(data, list):
                raise DataError(
                    f"{name}: a .json data file must hold a list of rows (or one JSON row per "
                    f"line), got a {type(data).__name__}")
            return data, [f"{name} row {i}" for i in range(1, len(data) + 1)]
    rows, where = [], []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise DataError(
                f"{name} line {lineno}: invalid JSON ({e.msg} at column {e.colno}); each line "
                "must hold one JSON object") from None
        where.append(f"{name} line {lineno}")
    return rows, where


def _read_parquet(path: Path, name: str) -> tuple[list[Any], list[str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{name}: reading .parquet needs pyarrow: pip install pyarrow") from None
    try:
        rows = _drop_nulls(pq.read_table(path).to_pylist())
    except Exception as e:  # noqa: BLE001 - pyarrow raises many kinds
        raise DataError(f"{name}: not a readable parquet file ({type(e).__name__}: {e})") from None
    return rows, [f"{name} row {i}" for i in range(1, len(rows) + 1)]


def _read_file(path: Path, name: str) -> tuple[str, list[dict], list[Example], list[str]]:
    if path.suffix not in DATA_SUFFIXES:
        raise DataError(
            f"{name}: unsupported file type {path.suffix!r}; use .jsonl (one JSON row per line), "
            ".json (a list of rows), .parquet, a folder of those, a datasets save_to_disk "
            "folder or a hub dataset id")
    reader = _read_parquet if path.suffix == ".parquet" else _read_json_file
    rows, where = reader(path, name)
    fmt, examples = _check_file(rows, where, name)
    return fmt, rows, examples, where


def _split_of(rel: str) -> str | None:
    for part in reversed(Path(rel.lower()).parts):
        for word in re.split(r"[-._ 0-9]+", part):
            if word in SPLIT_KEYWORDS:
                return SPLIT_KEYWORDS[word]
    return None


def _choose_split(available: Sequence[str], split: str | None, held_out: bool, name: str) -> str:
    want = SPLIT_KEYWORDS.get(split.lower(), split) if split else None
    if want is not None:
        if want in available:
            return want
        raise DataError(f"{name}: no split {split!r}; it has {', '.join(sorted(available))}. "
                        "Pick one with --data-split / --eval-split")
    for cand in HELD_OUT_SPLITS if held_out else ("train",):
        if cand in available:
            return cand
    which = "held-out (validation or test)" if held_out else "train"
    raise DataError(f"{name}: no {which} split; it has {', '.join(sorted(available))}. Pick one "
                    "with --data-split / --eval-split")


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file())


def _read_saved_dataset(path: Path, name: str, split: str | None, held_out: bool):
    from yeto.data.provenance import dir_files

    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{name} is a datasets save_to_disk folder; reading it needs `datasets`: "
            "pip install datasets") from None
    ds = datasets.load_from_disk(str(path))
    chosen = None
    if isinstance(ds, datasets.DatasetDict):
        chosen = _choose_split(list(ds), split, held_out, name)
        ds = ds[chosen]
        files = dir_files(path / chosen)
    else:
        files = dir_files(path)
    label = f"{name}[{chosen}]" if chosen else name
    rows = _drop_nulls(ds.to_list())
    where = [f"{label} row {i}" for i in range(1, len(rows) + 1)]
    fmt, examples = _check_file(rows, where, label)
    return chosen, {label: fmt}, rows, examples, where, files


def _read_folder(path: Path, name: str, split: str | None, held_out: bool):
    if _is_saved_dataset(path):
        return _read_saved_dataset(path, name, split, held_out)
    from yeto.data.provenance import dir_files

    files = [p for p in dir_files(path) if p.suffix in DATA_SUFFIXES]
    if not files:
        raise DataError(f"{name}: no data files ({', '.join(DATA_SUFFIXES)}) in this folder")
    splits = {f: _split_of(f.relative_to(path).as_posix()) for f in files}
    chosen = None
    if any(splits.values()):
        chosen = _choose_split(sorted({s for s in splits.values() if s}), split, held_out, name)
        files = [f for f in files if splits[f] == chosen]
    elif split:
        raise DataError(f"{name}: --data-split/--eval-split {split!r} given, but no file in the "
                        "folder is named after a split; drop the flag")
    formats, rows, examples, where = {}, [], [], []
    for f in files:
        fname = f"{name.rstrip('/')}/{f.relative_to(path).as_posix()}"
        fmt, r, e, w = _read_file(f, fname)
        formats[fname] = fmt
        rows += r
        examples += e
        where += w
    return chosen, formats, rows, examples, where, files


def read_source(source: str | Path, *, revision: str | None = None, split: str | None = None,
                held_out: bool = False) -> Rows:
    """Read and validate every row of a data source (file, folder, saved dataset or hub
    id); see the module docstring. Raises DataError (or ProvenanceError for the hub)."""
    from yeto.data.provenance import files_digest, hub_snapshot, is_hub_id

    name = str(source)
    path = Path(source)
    record: dict[str, Any] = {"id": name}
    if path.exists():
        if revision:
            raise DataError(
                f"--data-revision {revision!r} applies to hub dataset ids, but {name!r} is a "
                "local path (pinned by its content digest instead); drop the flag")
        record.update(kind="local", path=str(path.resolve()))
        root = path
    elif is_hub_id(name) and not name.endswith(DATA_SUFFIXES):
        snap, commit = hub_snapshot(name, "dataset", revision)
        record.update(kind="hub", revision=revision or "main", commit=commit, path=str(snap))
        path, root, name = snap, snap, f"{name}@{commit[:10]}"
    else:
        raise DataError(
            f"data not found: {source} (pass a .jsonl/.json/.parquet file, a folder of them, a "
            "datasets save_to_disk folder, or a hub dataset id like org/name)")
    if path.is_dir():
        chosen, formats, rows, examples, where, files = _read_folder(path, name, split, held_out)
    else:
        if split:
            raise DataError(f"{name}: --data-split/--eval-split applies to folders and hub "
                            "datasets, not to a single file; drop the flag")
        fmt, rows, examples, where = _read_file(path, name)
        chosen, formats, files, root = None, {name: fmt}, [path], path.parent
    record.update(split=chosen, formats=formats, rows=len(rows),
                  files=[f.relative_to(root).as_posix() for f in files],
                  digest=files_digest(files, root))
    return Rows(rows, examples, where, formats, record)


def load_rows(path: str | Path) -> list[dict]:
    """The raw rows of a data source (validated; see `read_source`)."""
    return read_source(path).rows


def shard_rows(rows: Sequence[Any], index: int, count: int) -> list[Any]:
    """Rows of island ``index`` out of ``count``: row i goes to island i mod count."""
    if count < 1 or not 0 <= index < count:
        raise DataError(f"bad shard {index}/{count}: need count >= 1 and 0 <= index < count")
    return list(rows[index::count])


# ---------------------------------------------------------------- packing


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

    def __getitem__(self, idx) -> Blocks:
        """Blocks ``idx`` (a slice or index array), positions and info kept."""
        if isinstance(idx, (int, np.integer)):
            idx = slice(int(idx), int(idx) + 1)
        return Blocks(self.tokens[idx], self.weights[idx], self.positions[idx], self.info)

    @property
    def seq_len(self) -> int:
        return int(self.weights.shape[1])

    @property
    def loss_tokens(self) -> int:
        return int(np.count_nonzero(self.weights))

    @property
    def segments(self) -> np.ndarray:
        return segment_ids(self.positions)


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
    return (seg[:, :, None] == seg[:, None, :]) & causal


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
    encoded, methods, dropped = [], Counter(), []
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


class Batch(tuple):
    """One batch: unpacks as ``(tokens, weights)``, the pair the islands always took;
    ``.positions`` (int32 (b, seq_len)) carries the document structure on top."""

    positions: np.ndarray

    def __new__(cls, tokens: np.ndarray, weights: np.ndarray, positions: np.ndarray):
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
        return Batch(b.tokens[idx], b.weights[idx], np.ascontiguousarray(b.positions[idx]))
