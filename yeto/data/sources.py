"""Data sources: read and validate the rows of a file, a folder, a saved dataset or
a hub dataset id, choose a split, and shard rows between islands.

Sources (``read_source(source, ...)``, ``load_blocks``, ``yeto data SOURCE``):

* a local ``.jsonl`` (one row per line), ``.json`` (a list of rows, or JSON lines)
  or ``.parquet`` file;
* a local folder of such files (hidden paths skipped). Its files are assigned to
  splits exactly as ``datasets.load_dataset(folder)`` assigns them, with the data-file
  patterns of ``datasets`` itself (`datasets.data_files.get_data_patterns`):
  sharded names such as ``data/train-00000-of-00002.parquet``, or folder or file
  names carrying ``train``/``training``, ``validation``/``valid``/``dev``/``val``,
  ``test``/``testing``/``eval``/``evaluation``. One split is read: ``split=``
  (``--data-split``; a keyword above names its split, e.g. ``dev`` is
  ``validation``), else ``train`` for training data and ``validation``, then
  ``test``, for held-out data. A folder whose names carry no split is read whole;
* a folder written by ``datasets``' ``save_to_disk`` (a Dataset, or a DatasetDict
  with the split chosen as above);
* a hub dataset id (``org/name``), resolved to a commit (``revision=``,
  ``--data-revision``) through the local Hugging Face cache (see
  yeto.data.provenance), then read as a folder.

Folders, saved datasets and hub ids need ``datasets`` (imported only then: pip
install datasets); single files need only the standard library (and pyarrow for
parquet).

Row formats (text, OpenAI messages, ShareGPT, Alpaca, prompt/completion) are
detected per file and described in `yeto.data.formats`; a row of another format
than its file's first row is an error naming the file and line.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

from yeto.data.formats import ACCEPTED_SCHEMAS, DataError, Example, detect_format, to_example

__all__ = ["DATA_SUFFIXES", "HELD_OUT_SPLITS", "Rows", "load_rows", "read_source",
           "shard_rows"]

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
HELD_OUT_SPLITS = ("validation", "test")  # tried in this order for held-out data


# ---------------------------------------------------------------- rows and files


@dataclass
class Rows:
    """Validated rows of one source, with where each came from and its format."""

    rows: list[dict[str, Any]]
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


def _check_file(rows: list[dict[str, Any]], where: list[str], name: str
                ) -> tuple[str, list[Example]]:
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


def _drop_nulls(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # Columnar sources give every row every column; a null there means "absent".
    return [{k: v for k, v in r.items() if v is not None} for r in rows]


# one JSON row at most this long (a 100 MB chat row took 21.8 GB to tokenize); a .json
# file holding a list is read whole and bounded by the row count instead
MAX_ROW_BYTES = 8 << 20


def _read_json_file(path: Path, name: str) -> tuple[list[Any], list[str]]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        bad = e.object[e.start:e.start + 1]
        raise DataError(f"{name}: not UTF-8 text (byte {e.start}: {bad!r}); JSON data files "
                        "are UTF-8: convert it (iconv -t utf-8)") from None
    if path.suffix == ".json":
        try:
            data = json.loads(text) if text.strip() else []
        except RecursionError:
            raise DataError(f"{name}: JSON nested too deeply to be a data row") from None
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
        if len(line) > MAX_ROW_BYTES:
            raise DataError(f"{name} line {lineno}: a row of {len(line):,} characters (at most "
                            f"{MAX_ROW_BYTES:,}); split it into several rows")
        try:
            rows.append(json.loads(line))
        except RecursionError:
            raise DataError(f"{name} line {lineno}: JSON nested too deeply to be a data "
                            "row") from None
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


def _read_file(path: Path, name: str) -> tuple[str, list[dict[str, Any]], list[Example], list[str]]:
    if path.suffix not in DATA_SUFFIXES:
        raise DataError(
            f"{name}: unsupported file type {path.suffix!r}; use .jsonl (one JSON row per line), "
            ".json (a list of rows), .parquet, a folder of those, a datasets save_to_disk "
            "folder or a hub dataset id")
    reader = _read_parquet if path.suffix == ".parquet" else _read_json_file
    rows, where = reader(path, name)
    fmt, examples = _check_file(rows, where, name)
    return fmt, rows, examples, where


# ---------------------------------------------------------------- splits


def _datasets(name: str, what: str) -> Any:
    """The `datasets` module (imported here only: it is optional and slow to import)."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{name} is {what}; reading it needs `datasets`: pip install datasets (or pass "
            "one .jsonl/.json/.parquet file)") from None
    return datasets


def _split_names() -> dict[str, str]:
    """keyword -> split, from `datasets`' own table (``dev`` -> ``validation``, ...)."""
    from datasets.data_files import SPLIT_KEYWORDS

    return {kw: str(split) for split, kws in SPLIT_KEYWORDS.items() for kw in kws}


def _choose_split(available: Sequence[str], split: str | None, held_out: bool, name: str) -> str:
    if split:
        for want in (split, _split_names().get(split.lower())):
            if want is not None and want in available:
                return want
        raise DataError(f"{name}: no split {split!r}; it has {', '.join(sorted(available))}. "
                        "Pick one with --data-split / --eval-split")
    for cand in HELD_OUT_SPLITS if held_out else ("train",):
        if cand in available:
            return cand
    which = "held-out (validation or test)" if held_out else "train"
    raise DataError(f"{name}: no {which} split; it has {', '.join(sorted(available))}. Pick one "
                    "with --data-split / --eval-split")


def _folder_splits(path: Path, name: str) -> dict[str | None, list[Path]]:
    """The folder's data files by split, as ``datasets.load_dataset(folder)`` assigns
    them (`datasets.data_files.get_data_patterns`); ``{None: files}`` when no file or
    folder name carries a split."""
    _datasets(name, "a folder")
    from datasets.data_files import (
        DEFAULT_PATTERNS_ALL,
        EmptyDatasetError,
        get_data_patterns,
        resolve_pattern,
    )

    base = path.absolute()
    try:
        patterns = {str(k): v for k, v in get_data_patterns(str(base)).items()}
    except EmptyDatasetError:
        patterns = {}
    by_split: dict[str | None, list[Path]] = {}
    for split, pats in patterns.items():
        found = set()
        for pattern in pats:
            try:
                found.update(resolve_pattern(pattern, str(base)))
            except FileNotFoundError:
                continue
        files = sorted(path / Path(f).relative_to(base) for f in found)
        files = [f for f in files if f.suffix in DATA_SUFFIXES]
        if files:
            by_split[split] = files
    if not by_split:
        raise DataError(f"{name}: no data files ({', '.join(DATA_SUFFIXES)}) in this folder")
    if patterns == {str(k): v for k, v in DEFAULT_PATTERNS_ALL.items()}:
        return {None: by_split["train"]}  # no split names: the whole folder
    return by_split


# ---------------------------------------------------------------- folders and sources


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file())


# (split chosen, {label: format}, rows, examples, where each row is, files read)
_Read: TypeAlias = tuple[str | None, dict[str, str], list[dict[str, Any]], list[Example],
                         list[str], list[Path]]


def _read_saved_dataset(path: Path, name: str, split: str | None, held_out: bool) -> _Read:
    from yeto.data.provenance import dir_files

    datasets = _datasets(name, "a datasets save_to_disk folder")
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


def _read_folder(path: Path, name: str, split: str | None, held_out: bool) -> _Read:
    if _is_saved_dataset(path):
        return _read_saved_dataset(path, name, split, held_out)
    splits = _folder_splits(path, name)
    chosen = None
    if None in splits:
        if split:
            raise DataError(f"{name}: --data-split/--eval-split {split!r} given, but no file in "
                            "the folder is named after a split; drop the flag")
        files = splits[None]
    else:
        chosen = _choose_split([s for s in splits if s is not None], split, held_out, name)
        files = splits[chosen]
    formats: dict[str, str] = {}
    rows: list[dict[str, Any]] = []
    examples: list[Example] = []
    where: list[str] = []
    for f in files:
        fname = f"{name.rstrip('/')}/{f.relative_to(path).as_posix()}"
        fmt, r, e, w = _read_file(f, fname)
        formats[fname] = fmt
        rows += r
        examples += e
        where += w
    return chosen, formats, rows, examples, where, files


def _locate(source: str | Path, revision: str | None) -> tuple[Path, str, dict[str, Any]]:
    """(path to read, name for messages, provenance record) of a local path or hub id."""
    from yeto.data.provenance import hub_snapshot, is_hub_id

    name = str(source)
    path = Path(source)
    record: dict[str, Any] = {"id": name}
    if path.exists():
        if revision:
            raise DataError(
                f"--data-revision {revision!r} applies to hub dataset ids, but {name!r} is a "
                "local path (pinned by its content digest instead); drop the flag")
        record.update(kind="local", path=str(path.resolve()))
        return path, name, record
    if is_hub_id(name) and not name.endswith(DATA_SUFFIXES):
        snap, commit = hub_snapshot(name, "dataset", revision)
        record.update(kind="hub", revision=revision or "main", commit=commit, path=str(snap))
        return snap, f"{name}@{commit[:10]}", record
    raise DataError(
        f"data not found: {source} (pass a .jsonl/.json/.parquet file, a folder of them, a "
        "datasets save_to_disk folder, or a hub dataset id like org/name)")


def read_source(source: str | Path, *, revision: str | None = None, split: str | None = None,
                held_out: bool = False) -> Rows:
    """Read and validate every row of a data source (file, folder, saved dataset or hub
    id); see the module docstring. Raises DataError (or ProvenanceError for the hub)."""
    from yeto.data.provenance import files_digest

    path, name, record = _locate(source, revision)
    if path.is_dir():
        chosen, formats, rows, examples, where, files = _read_folder(path, name, split, held_out)
        root = path
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


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """The raw rows of a data source (validated; see `read_source`)."""
    return read_source(path).rows


def shard_rows(rows: Sequence[Any], index: int, count: int) -> list[Any]:
    """Rows of island ``index`` out of ``count``: row i goes to island i mod count."""
    if count < 1 or not 0 <= index < count:
        raise DataError(f"bad shard {index}/{count}: need count >= 1 and 0 <= index < count")
    return list(rows[index::count])
