"""The syncer's files: the state (after every committed round) and the final folder.

`state.safetensors` holds Θ and the outer momentum as tensors (the momentum only
when it is not 0: with momentum 0 it is zero by definition and the run keeps none);
its metadata holds a JSON document with the version, the round counter, the layout,
the flags that change the math, the island ledger, and SHA-256 digests of the
tensors; a digest of that document covers the whole state (`StateKey`): HMAC-SHA256
under a key derived from the run's secret when the run has one, so whoever can write
the state dir without holding the secret cannot make a state that resumes. It is
written atomically (`yeto.io.atomic_file`: temp file, fsync, rename)
after every committed round, so a crash leaves either the old state or the new one.

Files are written and read in the safetensors format by `write_safetensors` /
`read_safetensors` here, streaming from and into the arrays (a file's header is
checked against the file's size before anything is allocated for it): `safetensors.numpy`
builds the whole file as one `bytes` object first (and `safe_open` hands out
read-only copies), which would cost the syncer more memory than Θ itself. The files
are ordinary safetensors files: `safetensors.safe_open` and peft load them.

`final/` gets the final weights (in the islands' own file name, e.g. a peft
adapter), the files the islands sent along (e.g. `adapter_config.json`) and a
`provenance.json` like every other output folder.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
from collections.abc import Iterable, Mapping
from io import FileIO
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from yeto.io import atomic_file, atomic_write

if TYPE_CHECKING:
    from syncer.config import Config

STATE_FILE = "state.safetensors"
FINAL_DIR = "final"
# 3: the metadata digest is keyed when the run has a secret (`StateKey`); 2: its plain
# SHA-256; 1: no metadata digest. 2 and 1 still load in a run without a secret.
FORMAT = 3
# flags whose change would make a resumed run a different computation
MATH_FLAGS = ("outer", "outer_lr", "outer_momentum", "merge", "clip_factor", "downlink",
              "fragments")
# what a state saved before a flag existed ran with
FLAG_DEFAULTS = {"outer": "nesterov"}
# the weights the islands hold, when a compressed downlink makes them differ from Θ
ISLAND_THETA = "island_theta"
META_DIGEST = "meta_sha256"  # the metadata's own digest, beside the tensors'
DIGEST_KIND = "meta_digest"  # how META_DIGEST was made: "hmac-sha256" or "sha256"
KEYED, PLAIN = "hmac-sha256", "sha256"


class StateError(RuntimeError):
    """A state file that cannot be resumed from."""


_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64,
           "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
_WRITE_BYTES = 16 << 20  # one write call's slice of a tensor
_MAX_HEADER = 100 << 20  # as safetensors itself
_MAX_DIMS = 32  # numpy's own limit is 64; no tensor of a run has more than a few


def _bytes_of(a: np.ndarray) -> memoryview:
    return np.ascontiguousarray(a).data.cast("B")


def _meta_body(meta: dict[str, Any]) -> bytes:
    return json.dumps({k: v for k, v in meta.items() if k != META_DIGEST},
                      sort_keys=True).encode()


def meta_digest(meta: dict[str, Any]) -> str:
    """SHA-256 of the state's metadata (everything but this digest itself): with the
    tensors' own digests in it, it covers the whole state."""
    return hashlib.sha256(_meta_body(meta)).hexdigest()


class StateKey:
    """What a state's metadata digest is made with, and the check of a saved one.

    With the run's secret: HMAC-SHA256 under a key derived from it (`LABEL` is no
    learner id, so no island credential is that key). A peer who can write the state
    dir but holds no secret cannot make a state that resumes; a run with a secret
    resumes only such a state. Without a secret: plain SHA-256, which catches
    corruption only (anyone can recompute it); such a run resumes unkeyed states
    (formats 1 and 2 too) and refuses keyed ones, whose digest it cannot check."""

    LABEL = b"yeto state digest v1"

    def __init__(self, secret: str | None):
        self._key = (hmac.new(secret.encode(), self.LABEL, hashlib.sha256).digest()
                     if secret else None)
        self.kind = KEYED if self._key is not None else PLAIN

    def digest(self, meta: dict[str, Any]) -> str:
        if self._key is None:
            return meta_digest(meta)
        return hmac.new(self._key, _meta_body(meta), hashlib.sha256).hexdigest()

    def check(self, path: Path, meta: dict[str, Any], trust_unkeyed: bool = False) -> None:
        """Refuse (StateError) a state whose metadata this run cannot vouch for.
        `trust_unkeyed`: the operator vouches for an unkeyed state (checked as one)."""
        kind = meta.get(DIGEST_KIND, PLAIN if meta["format"] >= 2 else None)
        if self._key is not None and kind != KEYED and trust_unkeyed:
            StateKey(None).check(path, meta)
            return
        if self._key is not None and kind != KEYED:
            raise StateError(
                f"{path} carries no digest under the run's secret (it was saved by a run "
                "without --token / $YETO_TOKEN, or by a yeto older than keyed states): "
                "anyone who can write its folder could have made it, so this run, which "
                "has a secret, does not resume it unless you vouch for it: "
                "--trust-unkeyed-state (once; it is saved under the secret from then on). "
                "Or start a new run with another --state-dir")
        if self._key is None and kind == KEYED:
            raise StateError(
                f"{path} was saved by a run with a secret, and its digest can be checked "
                "with that secret only: resume with the same --token (or $YETO_TOKEN)")
        if kind is not None and not hmac.compare_digest(
                str(meta.get(META_DIGEST, "")), self.digest(meta)):
            under = " under this run's secret" if kind == KEYED else ""
            raise StateError(
                f"{path}: its metadata (version, ledger, layout, the tensors' digests) does "
                f"not match its digest{under}: changed or corrupted on disk"
                + (", or saved by a run with another secret" if kind == KEYED else "") +
                "; it was left untouched. Resume with the secret the run was saved "
                "with, restore a backup or start a new run with another --state-dir")


def make_private_dir(path: Path) -> None:
    """Create `path` (and parents) readable by this user only (0700); an existing
    folder keeps its mode."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)


def digest(a: np.ndarray) -> str:
    """SHA-256 of an array's bytes (no copy of a contiguous array)."""
    return hashlib.sha256(_bytes_of(a)).hexdigest()


def write_safetensors(f: IO[bytes], tensors: dict[str, np.ndarray],
                      metadata: dict[str, str]) -> None:
    """Write `tensors` to the binary file `f` in the safetensors format: an 8-byte
    header length, the JSON header (padded to 8 bytes), then each tensor's raw
    little-endian bytes, written slice by slice from the arrays themselves."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
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
    renamed over it). Every tensor's entry in the header is checked against the bytes
    the file really holds before any array is made (a shape of 2^40 is refused, not
    allocated). Raises ValueError, naming the tensor and the field, on a malformed
    file."""
    with open(path, "rb", buffering=0) as f:
        size = f.seek(0, 2)
        f.seek(0)
        head = _read_exact(f, 8)
        n = struct.unpack("<Q", head)[0]
        if n > min(_MAX_HEADER, size - 8):
            raise ValueError(f"header of {n} bytes in a file of {size}")
        header = json.loads(_read_exact(f, n))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict):
            raise ValueError("__metadata__ is not a JSON object")
        entries = sorted(_entry(name, info, size - 8 - n) for name, info in header.items())
        tensors, end = {}, 0
        for lo, hi, name, dtype, shape in entries:
            if lo != end:
                raise ValueError(f"{name}: data_offsets start at {lo}, not at {end} where "
                                 "the tensor before it ends")
            a: np.ndarray = np.empty(shape, dtype)
            f.seek(8 + n + lo)
            _read_into(f, a.data.cast("B") if a.nbytes else memoryview(b""))
            tensors[name], end = a, hi
        if 8 + n + end != size:
            raise ValueError(f"{size - 8 - n - end} bytes after the last tensor")
    return tensors, metadata


def _entry(name: str, info: object, body: int) -> tuple[int, int, str, type, list[int]]:
    """(start, end, name, dtype, shape) of one tensor's header entry, checked against
    the `body` bytes of tensor data the file holds: a well-formed dtype, shape and
    data_offsets, and a shape whose bytes are the offsets' span (Python ints: no
    wrap-around)."""
    if not isinstance(info, dict):
        raise ValueError(f"{name}: its header entry is not a JSON object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _DTYPES:
        raise ValueError(f"{name}: dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS or not all(
            type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"{name}: shape {shape!r} is not a list of at most {_MAX_DIMS} "
                         "sizes >= 0")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(
            type(o) is int for o in offsets) or not 0 <= offsets[0] <= offsets[1] <= body:
        raise ValueError(f"{name}: data_offsets {offsets!r} do not lie within the {body} "
                         "bytes of tensor data the file holds")
    need = math.prod(shape) * np.dtype(_DTYPES[dtype]).itemsize
    if need != offsets[1] - offsets[0]:
        raise ValueError(f"{name}: shape {shape} of {dtype} needs {need} bytes, but its "
                         f"data_offsets span {offsets[1] - offsets[0]} (the file holds "
                         f"{body} bytes of tensor data)")
    return offsets[0], offsets[1], name, _DTYPES[dtype], shape


def _read_exact(f: FileIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError(f"file ends after {len(data)} of {n} bytes")
    return data


def _read_into(f: FileIO, mv: memoryview) -> None:
    got = 0
    while got < len(mv):
        k = f.readinto(mv[got:])
        if not k:
            raise ValueError(f"file ends after {got} of {len(mv)} bytes of a tensor")
        got += k


def save(state_dir: Path, theta: np.ndarray, momentum: np.ndarray | None,
         island_theta: np.ndarray | None, meta: dict[str, Any], key: StateKey | None = None
         ) -> None:
    """`momentum`: None when the run keeps none (momentum 0; not stored). `island_theta`:
    the weights islands hold when the downlink is compressed (else None, or Θ itself:
    then it is not stored). `key`: what the metadata's digest is made with (None: a
    run without a secret, plain SHA-256)."""
    key = key or StateKey(None)
    tensors = {"theta": theta}
    if momentum is not None:
        tensors["momentum"] = momentum
    if island_theta is not None and island_theta is not theta and \
            not np.array_equal(island_theta, theta):
        tensors[ISLAND_THETA] = island_theta
    meta = dict(meta, format=FORMAT, **{f"{k}_sha256": digest(v) for k, v in tensors.items()})
    meta[DIGEST_KIND] = key.kind
    meta[META_DIGEST] = key.digest(meta)
    make_private_dir(Path(state_dir))
    with atomic_file(Path(state_dir) / STATE_FILE) as f:
        write_safetensors(f, tensors, {"yeto_state": json.dumps(meta, sort_keys=True)})


def load(state_dir: Path, key: StateKey | None = None, trust_unkeyed: bool = False
         ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, dict[str, Any]]:
    """(Θ, momentum or None when none was stored, the islands' weights or None,
    metadata) of a saved run. `key`: the resuming run's (`StateKey.check`: a state it
    cannot vouch for is refused); None reads a state without vouching for it (a tool
    looking at a run's files: the tensors' digests, and a plain metadata digest, are
    still checked)."""
    path = Path(state_dir) / STATE_FILE
    if not path.exists():
        raise StateError(f"no saved state in {state_dir} (expected {STATE_FILE}); start "
                         "without --resume to begin a new run")
    tensors, meta = _read(path)
    theta, momentum = tensors.get("theta"), tensors.get("momentum")
    if theta is None or meta.get("format") not in (1, 2, FORMAT):
        raise StateError(f"{path} is not a yeto syncer state (format {meta.get('format')})")
    if key is not None:
        key.check(path, meta, trust_unkeyed)
    elif meta.get(DIGEST_KIND) != KEYED:  # a reader without the key checks what it can
        StateKey(None).check(path, meta)
    for k, v in tensors.items():
        if v.dtype != np.float32 or v.shape != (theta.size,):
            raise StateError(f"{path}: tensor {k!r} is {v.dtype} of shape {list(v.shape)}; a "
                             "state holds flat float32 tensors the size of theta "
                             f"({theta.size}): not a yeto syncer state")
    if any(digest(v) != meta.get(f"{k}_sha256") for k, v in tensors.items()):
        raise StateError(f"{path}: tensor digests do not match (corrupted on disk); it was "
                         "left untouched")
    island_theta = tensors.get(ISLAND_THETA)
    return theta, momentum, island_theta, meta


def _read(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Tensors and metadata from one open of the file."""
    try:
        tensors, metadata = read_safetensors(path)
        meta = json.loads(metadata["yeto_state"])
        if not isinstance(meta, dict):
            raise ValueError("its yeto_state metadata is not a JSON object")
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise StateError(f"{path} is corrupt or truncated ({e}); it was left untouched. "
                         "Restore a backup or start a new run with another --state-dir") from None
    return tensors, meta


def check_flags(meta: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse a resume whose math-changing flags differ from the saved run's."""
    saved = {k: meta["flags"].get(k, FLAG_DEFAULTS.get(k)) for k in MATH_FLAGS}
    diffs = [f"--{k.replace('_', '-')} was {saved[k]!r}, now {current[k]!r}"
             for k in MATH_FLAGS if saved[k] != current.get(k)]
    if diffs:
        raise StateError("cannot resume: " + "; ".join(diffs) + ". Pass the saved run's "
                         "flags, or start a new run with another --state-dir")


# ---- the final folder ---------------------------------------------------------------
def write_final(out: Path, weights_file: str, tensors: dict[str, np.ndarray], version: int,
                export_files: dict[str, str], provenance: dict[str, Any]) -> None:
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


def final_provenance(config: Config | Mapping[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """provenance.json of the syncer's final/: yeto's version and code digest, the
    environment, the run's config and `run` (id, version, layout, islands)."""
    from yeto.data.provenance import REDACTED_ARGS, build_record

    fields = dict(config) if isinstance(config, Mapping) else config.public()
    record = build_record(None, None, fields, backend=None)
    record["command"] = redact_command(record["command"], REDACTED_ARGS)
    record["syncer"] = run
    return record


def redact_command(argv: list[str], secret_args: Iterable[str]) -> list[str]:
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
