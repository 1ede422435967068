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

See PROVENANCE.md for the policy.
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

from yeto import gguf
from yeto.io import atomic_write
from yeto.version import __version__

logger = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# What a hub model snapshot may fetch: never pickles, code only when trusted.
MODEL_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt",
               "*.jinja"]
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
    return constants.HF_HUB_CACHE


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


def check_weights(path: Path, name: str) -> list[str]:
    """The safetensors weight files of a model dir; refuses pickled-only models."""
    files = [p for p in sorted(path.iterdir()) if p.is_file()]
    safe = [p.name for p in files if p.suffix == ".safetensors"]
    if safe:
        return safe
    pickled = [p.name for p in files if p.suffix in PICKLE_SUFFIXES]
    if pickled:
        raise ProvenanceError(
            f"model {name!r} has only pickled weights ({', '.join(pickled)}); yeto loads "
            "safetensors only, because unpickling a checkpoint can run arbitrary code. Convert "
            "it once, in an environment you trust, e.g. python -c \"from transformers import "
            f"AutoModelForCausalLM as M; M.from_pretrained('{path}', use_safetensors=False)"
            f".save_pretrained('{path}-safetensors')\", or use a revision that ships "
            "model.safetensors")
    raise ProvenanceError(
        f"model {name!r}: no *.safetensors weights in {path}; yeto loads safetensors only (from "
        "the hub it never fetches pickled *.bin/*.pt files), so use a revision or a copy of the "
        "model that ships model.safetensors")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def check_remote_code(path: Path, name: str, trust: bool) -> None:
    """Refuse a model that needs its own code unless ``trust`` (--trust-remote-code)."""
    from transformers import CONFIG_MAPPING

    config = _read_json(path / "config.json")
    tok_config = _read_json(path / "tokenizer_config.json")
    needs = []
    if config.get("auto_map") and config.get("model_type") not in CONFIG_MAPPING:
        needs.append(f"config.json auto_map {config['auto_map']}")
    tok_class = tok_config.get("tokenizer_class")
    if tok_config.get("auto_map") and tok_class:
        import transformers

        base = tok_class.removesuffix("Fast")
        if not (hasattr(transformers, tok_class) or hasattr(transformers, base)):
            needs.append(f"tokenizer_config.json auto_map {tok_config['auto_map']}")
    if needs and not trust:
        raise ProvenanceError(
            f"model {name!r} needs code shipped in the model repo ({'; '.join(needs)}); yeto "
            "runs no code from a model repo unless told --trust-remote-code. Read the .py files "
            f"in {path}, pin --model-revision to a commit, then rerun with --trust-remote-code")
    if config.get("auto_map") and not needs and not trust:
        logger.info("%s: ignoring auto_map, transformers' built-in %r is used",
                    name, config.get("model_type"))
    if trust:
        logger.warning("%s: --trust-remote-code is on: code from the model repo may run", name)


def resolve_model(model: str, revision: str | None = None, trust_remote_code: bool = False,
                  need_weights: bool = True) -> ModelSource:
    """Pin a model (local dir -> content digest; hub id -> commit; a .gguf file -> its
    digest, read into a cached model dir by `yeto.gguf`) and check it is safe to load:
    safetensors weights (if ``need_weights``), no remote code unless trusted."""
    path = Path(model)
    if gguf.is_gguf(path):  # read once into a cached model dir (yeto.gguf)
        if revision:
            raise ProvenanceError(f"--model-revision {revision!r} applies to hub ids, but "
                                  f"{model!r} is a GGUF file; drop the flag")
        src = ModelSource(model, gguf.model_dir(path), "gguf",
                          trust_remote_code=trust_remote_code)
        src.weights = check_weights(src.path, model)
        src.digest = "sha256:" + gguf.file_digest(path)
        return src
    if path.exists():
        if not path.is_dir():
            raise ProvenanceError(f"model {model!r} is a file; pass a Hugging Face model dir "
                                  "or a .gguf file")
        if revision:
            raise ProvenanceError(
                f"--model-revision {revision!r} applies to hub ids, but {model!r} is a local "
                "dir (pinned by its content digest instead); drop the flag")
        src = ModelSource(model, path.resolve(), "local", trust_remote_code=trust_remote_code)
    elif is_hub_id(model):
        patterns = MODEL_FILES + (["*.py"] if trust_remote_code else [])
        snap, commit = hub_snapshot(model, "model", revision, allow_patterns=patterns)
        src = ModelSource(model, snap, "hub", revision or "main", commit,
                          trust_remote_code=trust_remote_code)
    else:
        raise FileNotFoundError(
            f"model {model!r} not found: pass a local Hugging Face model dir or a hub id. "
            "Example: yeto make-tiny-model runs/tiny && python -m yeto.learner --model "
            "runs/tiny ...")
    if need_weights:
        src.weights = check_weights(src.path, model)
    check_remote_code(src.path, model, trust_remote_code)
    if src.kind == "local":
        t0 = time.perf_counter()
        src.digest = dir_digest(src.path)
        logger.info("model %s: %s (%.1fs)", model, src.digest, time.perf_counter() - t0)
    return src


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


def build_record(model: ModelSource | dict | None, data: dict | None, args: Any = None,
                 eval_data: dict | None = None, backend: str | None = None) -> dict[str, Any]:
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
