"""The syncer's files: the state (after every committed round) and the final folder.

`state.safetensors` holds Θ and the outer momentum as tensors (the momentum only
when it is not 0: with momentum 0 it is zero by definition and the run keeps none);
its metadata holds a JSON document with the version, the round counter, the layout,
the flags that change the math, the island ledger, and SHA-256 digests of the
tensors. It is written atomically (`yeto.io.atomic_file`: temp file, fsync, rename)
after every committed round, so a crash leaves either the old state or the new one.

Files are written and read in the safetensors format by `write_safetensors` /
`read_safetensors` here, streaming from and into the arrays: `safetensors.numpy`
builds the whole file as one `bytes` object first (and `safe_open` hands out
read-only copies), which would cost the syncer more memory than Θ itself. The files
are ordinary safetensors files: `safetensors.safe_open` and peft load them.

`final/` gets the final weights (in the islands' own file name, e.g. a peft
adapter), the files the islands sent along (e.g. `adapter_config.json`) and a
`provenance.json` like every other output folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from pathlib import Path

import numpy as np

from yeto.io import atomic_file, atomic_write

STATE_FILE = "state.safetensors"
FINAL_DIR = "final"
FORMAT = 2  # 2: the metadata is under its own digest too; 1 (no metadata digest) still loads
# flags whose change would make a resumed run a different computation
MATH_FLAGS = ("outer", "outer_lr", "outer_momentum", "merge", "clip_factor", "downlink",
              "fragments")
# what a state saved before a flag existed ran with
FLAG_DEFAULTS = {"outer": "nesterov"}
# the weights the islands hold, when a compressed downlink makes them differ from Θ
ISLAND_THETA = "island_theta"
META_DIGEST = "meta_sha256"  # the metadata's own digest, beside the tensors'


class StateError(RuntimeError):
    """A state file that cannot be resumed from."""


_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64,
           "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
_WRITE_BYTES = 16 << 20  # one write call's slice of a tensor
_MAX_HEADER = 100 << 20  # as safetensors itself


def _bytes_of(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a)).cast("B")


def meta_digest(meta: dict) -> str:
    """SHA-256 of the state's metadata (everything but this digest itself): with the
    tensors' own digests in it, it covers the whole state."""
    body = {k: v for k, v in meta.items() if k != META_DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def make_private_dir(path: Path) -> None:
    """Create `path` (and parents) readable by this user only (0700); an existing
    folder keeps its mode."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)


def digest(a: np.ndarray) -> str:
    """SHA-256 of an array's bytes (no copy of a contiguous array)."""
    return hashlib.sha256(_bytes_of(a)).hexdigest()


def write_safetensors(f, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """Write `tensors` to the binary file `f` in the safetensors format: an 8-byte
    header length, the JSON header (padded to 8 bytes), then each tensor's raw
    little-endian bytes, written slice by slice from the arrays themselves."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, a in tensors.items():
        if np.dtype(a.dtype) not in _NAMES:
            raise ValueError(f"{name}: dtype {a.dtype} has no safetensors name")
        header[name] = dict(dtype=_NAMES[np.dtype(a.dtype)], shape=list(a.shape),
                            data_offsets=[offset, offset + a.nbytes])
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for a in tensors.values():
        mv = _bytes_of(a.astype(a.dtype.newbyteorder("<"), copy=False))
        for lo in range(0, len(mv), _WRITE_BYTES):
            f.write(mv[lo:lo + _WRITE_BYTES])


def read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of a safetensors file, read straight into new writable
    arrays through one open file (one consistent version even while a newer one is
    renamed over it). Raises ValueError on a malformed file."""
    with open(path, "rb", buffering=0) as f:
        size = f.seek(0, 2)
        f.seek(0)
        head = _read_exact(f, 8)
        n = struct.unpack("<Q", head)[0]
        if n > min(_MAX_HEADER, size - 8):
            raise ValueError(f"header of {n} bytes in a file of {size}")
        header = json.loads(_read_exact(f, n))
        metadata = header.pop("__metadata__", None) or {}
        tensors, end = {}, 0
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
            lo, hi = info["data_offsets"]
            a = np.empty(info["shape"], _DTYPES[info["dtype"]])
            if lo != end or hi - lo != a.nbytes:
                raise ValueError(f"{name}: data offsets {lo}..{hi} do not fit its shape")
            f.seek(8 + n + lo)
            _read_into(f, memoryview(a).cast("B") if a.nbytes else memoryview(b""))
            tensors[name], end = a, hi
        if 8 + n + end != size:
            raise ValueError(f"{size - 8 - n - end} bytes after the last tensor")
    return tensors, metadata


def _read_exact(f, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError(f"file ends after {len(data)} of {n} bytes")
    return data


def _read_into(f, mv: memoryview) -> None:
    got = 0
    while got < len(mv):
        k = f.readinto(mv[got:])
        if not k:
            raise ValueError(f"file ends after {got} of {len(mv)} bytes of a tensor")
        got += k


def save(state_dir: Path, theta: np.ndarray, momentum: np.ndarray | None,
         island_theta: np.ndarray | None, meta: dict) -> None:
    """`momentum`: None when the run keeps none (momentum 0; not stored). `island_theta`:
    the weights islands hold when the downlink is compressed (else None, or Θ itself:
    then it is not stored)."""
    tensors = {"theta": theta}
    if momentum is not None:
        tensors["momentum"] = momentum
    if island_theta is not None and island_theta is not theta and \
            not np.array_equal(island_theta, theta):
        tensors[ISLAND_THETA] = island_theta
    meta = dict(meta, format=FORMAT, **{f"{k}_sha256": digest(v) for k, v in tensors.items()})
    meta[META_DIGEST] = meta_digest(meta)
    make_private_dir(Path(state_dir))
    with atomic_file(Path(state_dir) / STATE_FILE) as f:
        write_safetensors(f, tensors, {"yeto_state": json.dumps(meta, sort_keys=True)})


def load(state_dir: Path) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, dict]:
    """(Θ, momentum or None when none was stored, the islands' weights or None,
    metadata) of a saved run."""
    path = Path(state_dir) / STATE_FILE
    if not path.exists():
        raise StateError(f"no saved state in {state_dir} (expected {STATE_FILE}); start "
                         "without --resume to begin a new run")
    tensors, meta = _read(path)
    theta, momentum = tensors.get("theta"), tensors.get("momentum")
    if theta is None or meta.get("format") not in (1, FORMAT):
        raise StateError(f"{path} is not a yeto syncer state (format {meta.get('format')})")
    if any(digest(v) != meta.get(f"{k}_sha256") for k, v in tensors.items()):
        raise StateError(f"{path}: tensor digests do not match (corrupted on disk); it was "
                         "left untouched")
    if meta["format"] >= 2 and meta.get(META_DIGEST) != meta_digest(meta):
        raise StateError(f"{path}: its metadata (version, ledger, layout) does not match its "
                         "digest: changed or corrupted on disk; it was left untouched. Restore "
                         "a backup or start a new run with another --state-dir")
    island_theta = tensors.get(ISLAND_THETA)
    return theta, momentum, island_theta, meta


def _read(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """Tensors and metadata from one open of the file."""
    try:
        tensors, metadata = read_safetensors(path)
        meta = json.loads(metadata["yeto_state"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StateError(f"{path} is corrupt or truncated ({e}); it was left untouched. "
                         "Restore a backup or start a new run with another --state-dir") from None
    return tensors, meta


def check_flags(meta: dict, current: dict) -> None:
    """Refuse a resume whose math-changing flags differ from the saved run's."""
    saved = {k: meta["flags"].get(k, FLAG_DEFAULTS.get(k)) for k in MATH_FLAGS}
    diffs = [f"--{k.replace('_', '-')} was {saved[k]!r}, now {current[k]!r}"
             for k in MATH_FLAGS if saved[k] != current.get(k)]
    if diffs:
        raise StateError("cannot resume: " + "; ".join(diffs) + ". Pass the saved run's "
                         "flags, or start a new run with another --state-dir")


# ---- the final folder ---------------------------------------------------------------
def write_final(out: Path, weights_file: str, tensors: dict[str, np.ndarray], version: int,
                export_files: dict[str, str], provenance: dict) -> None:
    """Write `out/<weights_file>` (safetensors, loadable by peft when the islands train
    LoRA), the islands' export files and provenance.json."""
    from yeto.data.provenance import write_provenance

    metadata = {"format": "pt", "yeto_version": str(version)}
    with atomic_file(out / weights_file) as f:  # streamed from the arrays (views of Θ)
        write_safetensors(f, tensors, metadata)
    for name, text in export_files.items():
        if "/" in name or "\\" in name or name.startswith("."):
            continue  # file names only: never a path from the wire
        atomic_write(out / name, text)
    write_provenance(out, provenance)


def final_provenance(config, run: dict) -> dict:
    """provenance.json of the syncer's final/: yeto's version and code digest, the
    environment, the run's config and `run` (id, version, layout, islands)."""
    from yeto.data.provenance import REDACTED_ARGS, build_record

    fields = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    record = build_record(None, None, fields, backend=None)
    record["command"] = redact_command(record["command"], REDACTED_ARGS)
    record["syncer"] = run
    return record


def redact_command(argv: list[str], secret_args) -> list[str]:
    """`--token X` / `--token=X` with X replaced by <redacted>."""
    flags = {"--" + a.replace("_", "-") for a in secret_args}
    out, hide_next = [], False
    for arg in argv:
        name, eq, _ = arg.partition("=")
        if hide_next:
            out.append("<redacted>")
        elif eq and name in flags:
            out.append(f"{name}=<redacted>")
        else:
            out.append(arg)
        hide_next = arg in flags
    return out
