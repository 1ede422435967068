"""The syncer's files: the state (after every committed round) and the final folder.

`state.safetensors` holds Θ and the outer momentum as tensors; its metadata holds
a JSON document with the version, the round counter, the layout, the flags that
change the math, the island ledger, and SHA-256 digests of the tensors. It is
written atomically (`yeto.io.atomic_write`: temp file, fsync, rename) after every
committed round, so a crash leaves either the old state or the new one.

`final/` gets the final weights (in the islands' own file name, e.g. a peft
adapter), the files the islands sent along (e.g. `adapter_config.json`) and a
`provenance.json` like every other output folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from yeto.io import atomic_save, atomic_write

STATE_FILE = "state.safetensors"
FINAL_DIR = "final"
FORMAT = 1
# flags whose change would make a resumed run a different computation
MATH_FLAGS = ("outer_lr", "outer_momentum", "merge", "clip_factor", "downlink", "fragments")
# the weights the islands hold, when a compressed downlink makes them differ from Θ
ISLAND_THETA = "island_theta"
_OLD_ISLAND_THETA = "held"  # its name in state files written before it was renamed


class StateError(RuntimeError):
    """A state file that cannot be resumed from."""


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def save(state_dir: Path, theta: np.ndarray, momentum: np.ndarray,
         island_theta: np.ndarray | None, meta: dict) -> None:
    """`island_theta`: the weights islands hold when the downlink is compressed (else
    None, or Θ itself: then it is not stored)."""
    from safetensors.numpy import save

    tensors = {"theta": theta, "momentum": momentum}
    if island_theta is not None and island_theta is not theta and \
            not np.array_equal(island_theta, theta):
        tensors[ISLAND_THETA] = island_theta
    meta = dict(meta, format=FORMAT, **{f"{k}_sha256": digest(v) for k, v in tensors.items()})
    blob = save(tensors, metadata={"yeto_state": json.dumps(meta, sort_keys=True)})
    atomic_write(Path(state_dir) / STATE_FILE, blob)


def load(state_dir: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, dict]:
    """(Θ, momentum, the islands' weights or None, metadata) of a saved run."""
    path = Path(state_dir) / STATE_FILE
    if not path.exists():
        raise StateError(f"no saved state in {state_dir} (expected {STATE_FILE}); start "
                         "without --resume to begin a new run")
    tensors, meta = _read(path)
    theta, momentum = tensors.get("theta"), tensors.get("momentum")
    if theta is None or momentum is None or meta.get("format") != FORMAT:
        raise StateError(f"{path} is not a yeto syncer state (format {meta.get('format')})")
    if any(digest(v) != meta.get(f"{k}_sha256") for k, v in tensors.items()):
        raise StateError(f"{path}: tensor digests do not match (corrupted on disk); it was "
                         "left untouched")
    island_theta = tensors.get(ISLAND_THETA, tensors.get(_OLD_ISLAND_THETA))
    return theta, momentum, island_theta, meta


def _read(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """Tensors and metadata from one open of the file (one consistent version, even
    while a running syncer renames a newer one over it)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            meta = json.loads((f.metadata() or {})["yeto_state"])
    except (SafetensorError, OSError, ValueError, KeyError) as e:
        raise StateError(f"{path} is corrupt or truncated ({e}); it was left untouched. "
                         "Restore a backup or start a new run with another --state-dir") from None
    return tensors, meta


def check_flags(meta: dict, current: dict) -> None:
    """Refuse a resume whose math-changing flags differ from the saved run's."""
    diffs = [f"--{k.replace('_', '-')} was {meta['flags'][k]!r}, now {current[k]!r}"
             for k in MATH_FLAGS if meta["flags"].get(k) != current.get(k)]
    if diffs:
        raise StateError("cannot resume: " + "; ".join(diffs) + ". Pass the saved run's "
                         "flags, or start a new run with another --state-dir")


# ---- the final folder ---------------------------------------------------------------
def write_final(out: Path, weights_file: str, tensors: dict[str, np.ndarray], version: int,
                export_files: dict[str, str], provenance: dict) -> None:
    """Write `out/<weights_file>` (safetensors, loadable by peft when the islands train
    LoRA), the islands' export files and provenance.json."""
    from safetensors.numpy import save_file

    from yeto.data.provenance import write_provenance

    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    metadata = {"format": "pt", "yeto_version": str(version)}
    atomic_save(out / weights_file, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
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
