"""Provenance: pin models, data and code before training, and load them safely.

* Hub ids are resolved to a commit before anything is loaded (``--model-revision``,
  ``--data-revision``: a branch, tag or commit; default ``main``) and the snapshot
  at that commit is what gets loaded. With ``HF_HUB_OFFLINE=1`` only the local
  Hugging Face cache (``HF_HUB_CACHE``) is consulted and nothing is downloaded.
* Local dirs and files are pinned by a content digest (SHA-256 over relative
  paths, sizes and file hashes).
* Weights are safetensors only; a model that ships only pickled weights
  (``pytorch_model.bin``, ``*.pt``, ...) is refused, never unpickled.
* Code from a model repo (``auto_map`` in its config) runs only with
  ``--trust-remote-code``; without it, a model whose architecture transformers
  does not know is refused.
* ``provenance.json`` in every output folder records all of the above, the yeto
  version and a digest of yeto's own code, the environment and the full config
  (secrets redacted).

See PROVENANCE.md for the policy. Here: the digests, hub snapshots, `ModelSource` and
the records; `yeto.data.models.resolve_model` pins and checks a model (it needs
transformers and, for GGUF, torch, which the syncer writing its record never imports).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from yeto.io import atomic_write
from yeto.version import __version__

logger = logging.getLogger(__name__)

REDACTED_ARGS = ("token", "tls_key")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+")


class ProvenanceError(ValueError):
    """A model or dataset that cannot be pinned or loaded safely; says how to fix it."""


# ---------------------------------------------------------------- digests


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def files_digest(files: Iterable[Path], root: Path | None = None) -> str:
    """``sha256:<hex>`` over (relative path, size, sha256) of each file, sorted by path."""
    h = hashlib.sha256()
    entries = []
    for f in files:
        f = Path(f)
        name = f.relative_to(root).as_posix() if root is not None else f.name
        entries.append((name, f))
    for name, f in sorted(entries):
        h.update(f"{name}\0{f.stat().st_size}\0{_file_sha256(f)}\n".encode())
    return "sha256:" + h.hexdigest()


def dir_files(root: Path) -> list[Path]:
    """Regular files under ``root``, skipping hidden files and folders (.git, .cache)."""
    return sorted(
        p for p in root.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )


def dir_digest(root: Path) -> str:
    return files_digest(dir_files(root), root)


def code_digest() -> str:
    """Digest of yeto's own source (every .py and .proto file of the package)."""
    root = Path(__file__).resolve().parents[1]  # the whole package, not this folder
    files = [p for p in dir_files(root) if p.suffix in (".py", ".proto")]
    return files_digest(files, root)


def yeto_version() -> str:
    try:
        from importlib.metadata import version

        return version("yeto")
    except Exception:  # noqa: BLE001 - not installed: the source tree's own number
        return __version__


# ---------------------------------------------------------------- the hub


def is_hub_id(name: str) -> bool:
    return bool(_HUB_ID.fullmatch(name)) and not Path(name).exists()


def offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.HF_HUB_OFFLINE or env.strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_cache() -> str:
    """``HF_HUB_CACHE``, else ``HF_HOME/hub``, else huggingface_hub's default (read now,
    not at import, so a test or a wrapper script can point it elsewhere)."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    cache: str = constants.HF_HUB_CACHE
    return cache


def hub_snapshot(repo_id: str, repo_type: str, revision: str | None,
                 allow_patterns: list[str] | None = None) -> tuple[Path, str]:
    """Resolve ``repo_id@revision`` to a commit and return (snapshot dir, commit).

    Offline (``HF_HUB_OFFLINE=1``) the local cache's refs and snapshots answer;
    online the hub resolves the revision and missing files are fetched.
    """
    from huggingface_hub import snapshot_download

    rev = revision or "main"
    local_only = offline()
    cache = hub_cache()
    flag = "--model-revision" if repo_type == "model" else "--data-revision"
    try:
        path = Path(snapshot_download(repo_id, repo_type=repo_type, revision=rev, cache_dir=cache,
                                      local_files_only=local_only, allow_patterns=allow_patterns))
    except Exception as e:  # noqa: BLE001 - every miss gets the same actionable message
        where = f"the local hub cache ({cache}) in offline mode" if local_only else "the hub"
        fetch = f"hf download {repo_id}" + (" --repo-type dataset" if repo_type == "dataset"
                                            else "") + f" --revision {rev}"
        raise ProvenanceError(
            f"{repo_type} {repo_id!r} at revision {rev!r} could not be resolved from {where} "
            f"(and no local path {repo_id!r} exists): {type(e).__name__}: {str(e)[:300]}. "
            f"Check the id and {flag}; to fill the cache on a machine with network: "
            f"{fetch}") from None
    commit = path.name
    if not _COMMIT.fullmatch(commit):
        raise ProvenanceError(f"{repo_id}: resolved to {path}, which is not a commit snapshot")
    if revision and _COMMIT.fullmatch(revision) is None:
        logger.info("%s %s@%s pinned to commit %s", repo_type, repo_id, revision, commit)
    return path, commit


# ---------------------------------------------------------------- models


@dataclass
class ModelSource:
    """A model pinned for loading: where it is and what exactly it is."""

    id: str
    path: Path
    kind: str  # "local" | "hub" | "gguf"
    revision: str | None = None
    commit: str | None = None
    digest: str | None = None
    trust_remote_code: bool = False
    weights: list[str] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "path": str(self.path),
                "revision": self.revision, "commit": self.commit, "digest": self.digest,
                "weights": self.weights, "trust_remote_code": self.trust_remote_code}


# ---------------------------------------------------------------- records


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "platform": platform.platform()}
    for pkg in ("numpy", "torch", "transformers", "tokenizers", "peft", "safetensors",
                "huggingface_hub", "datasets", "mlx", "mlx-lm"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def _jsonable(v: Any) -> Any:
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    return repr(v)


def redacted_command(argv: list[str]) -> list[str]:
    """`argv` with the values of secret flags (--token, --tls-key) replaced, in both the
    `--flag VALUE` and the `--flag=VALUE` forms (a prefix argparse accepts, e.g. `--tok`,
    too)."""
    flags = tuple("--" + k.replace("_", "-") for k in REDACTED_ARGS)

    def secret(arg: str) -> bool:  # argparse takes any unambiguous prefix of a flag
        name = arg.split("=", 1)[0]
        return len(name) > 3 and any(f.startswith(name) for f in flags)

    out, hide_next = [], False
    for arg in argv:
        if hide_next:
            out.append("<redacted>")
            hide_next = False
        elif arg.startswith("--") and secret(arg):
            out.append(arg.split("=", 1)[0] + "=<redacted>" if "=" in arg else arg)
            hide_next = "=" not in arg
        else:
            out.append(arg)
    return out


def config_record(args: Any) -> dict[str, Any]:
    """The full config (an argparse Namespace or a dict), secrets redacted."""
    items = vars(args) if not isinstance(args, dict) else args
    return {k: ("<redacted>" if k in REDACTED_ARGS and v else _jsonable(v))
            for k, v in sorted(items.items())}


def build_record(model: ModelSource | dict[str, Any] | None, data: dict[str, Any] | None,
                 args: Any = None, eval_data: dict[str, Any] | None = None,
                 backend: str | None = None) -> dict[str, Any]:
    """The provenance.json content: what was trained, on what, by which code."""
    return {
        "format": 1,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "yeto": {"version": yeto_version(), "code_digest": code_digest()},
        "backend": backend,
        "command": redacted_command([sys.executable, *sys.argv]),
        "model": model.record() if isinstance(model, ModelSource) else model,
        "data": data,
        "eval_data": eval_data,
        "config": config_record(args) if args is not None else None,
        "environment": _versions(),
    }


def write_provenance(out_dir: str | Path, record: dict[str, Any]) -> Path:
    """Write ``out_dir/provenance.json`` atomically and return its path."""
    path = Path(out_dir) / "provenance.json"
    atomic_write(path, json.dumps(record, indent=2, sort_keys=False) + "\n")
    return path
