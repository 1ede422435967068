"""The syncer's state on disk: one safetensors file, written atomically.

`state.safetensors` holds Θ and the outer momentum as tensors; its metadata holds
a JSON document with the version, the round counter, the layout, the flags that
change the math, the island ledger, and SHA-256 digests of both tensors. It is
written to a temp file, fsynced and renamed over the old one after every
committed round, so a crash leaves either the old state or the new one.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

STATE_FILE = "state.safetensors"
FORMAT = 1
# flags whose change would make a resumed run a different computation
MATH_FLAGS = ("outer_lr", "outer_momentum", "merge", "clip_factor", "downlink", "fragments")


class StateError(RuntimeError):
    """A state file that cannot be resumed from."""


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def save(state_dir: Path, theta: np.ndarray, momentum: np.ndarray, held: np.ndarray | None,
         meta: dict) -> None:
    """`held`: the weights islands hold when the downlink is compressed (else None)."""
    from safetensors.numpy import save

    tensors = {"theta": theta, "momentum": momentum}
    if held is not None and held is not theta and not np.array_equal(held, theta):
        tensors["held"] = held
    meta = dict(meta, format=FORMAT, **{f"{k}_sha256": digest(v) for k, v in tensors.items()})
    blob = save(tensors,
                metadata={"yeto_state": json.dumps(meta, sort_keys=True)})
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / STATE_FILE
    tmp = state_dir / (STATE_FILE + ".tmp")
    with open(tmp, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(state_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself must survive a power cut
    finally:
        os.close(dir_fd)


def load(state_dir: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, dict]:
    from safetensors import SafetensorError
    from safetensors.numpy import load

    path = state_dir / STATE_FILE
    if not path.exists():
        raise StateError(f"no saved state in {state_dir} (expected {STATE_FILE}); start "
                         "without --resume to begin a new run")
    try:
        blob = path.read_bytes()
        tensors = load(blob)
        header_len = int.from_bytes(blob[:8], "little")
        meta = json.loads(json.loads(blob[8:8 + header_len])["__metadata__"]["yeto_state"])
    except (SafetensorError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise StateError(f"{path} is corrupt or truncated ({e}); it was left untouched. "
                         "Restore a backup or start a new run with another --state-dir") from None
    theta, momentum = tensors.get("theta"), tensors.get("momentum")
    if theta is None or momentum is None or meta.get("format") != FORMAT:
        raise StateError(f"{path} is not a yeto syncer state (format {meta.get('format')})")
    if any(digest(v) != meta.get(f"{k}_sha256") for k, v in tensors.items()):
        raise StateError(f"{path}: tensor digests do not match (corrupted on disk); it was "
                         "left untouched")
    return theta, momentum, tensors.get("held"), meta


def check_flags(meta: dict, current: dict) -> None:
    """Refuse a resume whose math-changing flags differ from the saved run's."""
    diffs = [f"--{k.replace('_', '-')} was {meta['flags'][k]!r}, now {current[k]!r}"
             for k in MATH_FLAGS if meta["flags"].get(k) != current.get(k)]
    if diffs:
        raise StateError("cannot resume: " + "; ".join(diffs) + ". Pass the saved run's "
                         "flags, or start a new run with another --state-dir")
