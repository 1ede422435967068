"""A model pinned and checked before it loads: `resolve_model` (the policy in
`yeto.data.provenance` and PROVENANCE.md).

* A hub id is resolved to a commit (``--model-revision``) and only its safe files are
  fetched (`MODEL_FILES`); a local dir is pinned by its content digest; a .gguf file
  by its digest, read once into a cached model dir (`yeto.gguf`).
* Weights are safetensors only: a model that ships only pickles is refused.
* Code from the model repo (``auto_map``) runs only with ``--trust-remote-code``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from yeto import gguf
from yeto.data.provenance import ModelSource, ProvenanceError, dir_digest, hub_snapshot, is_hub_id

logger = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# What a hub model snapshot may fetch: never pickles, code only when trusted.
MODEL_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt",
               "*.jinja"]


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
