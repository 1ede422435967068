"""A GGUF checkpoint (llama.cpp's single-file format) as a Hugging Face model dir.

Every program that takes `--model` (the torch and MLX islands, rollout nodes,
`yeto check-parity`, `yeto export`) accepts a `.gguf` file: `model_dir` reads it once
with transformers' GGUF reader (the `gguf` package: `pip install 'yeto[gguf]'`), which
dequantizes every tensor to float32, and writes an ordinary model dir (config.json,
model.safetensors, the tokenizer) into the cache, keyed by the file's SHA-256. Both
backends then load that same dir, so a torch island and an MLX island on one GGUF file
start from the same float32 weights and agree to the parity bound. The dir's
config.json also carries `rope_theta` at the top level, where mlx-lm reads it
(transformers 5 writes it only inside `rope_parameters`).

    model_dir("SmolLM2-135M-Instruct.Q4_1.gguf")  # -> ~/.cache/yeto/gguf/<sha>/

Cached under $YETO_CACHE (default ~/.cache/yeto)/gguf. Quantizations the reader cannot
dequantize, and architectures transformers cannot read from GGUF, are refused with
an error naming them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import uuid
from pathlib import Path

from yeto.io import cache_home

log = logging.getLogger("yeto")

SUFFIX = ".gguf"
DONE = ".yeto-gguf.json"  # written last: a dir without it is half-built and rebuilt


class GGUFError(ValueError):
    """A GGUF file yeto cannot turn into a model dir; the message says why and what to do."""


def is_gguf(model: str | Path) -> bool:
    return str(model).lower().endswith(SUFFIX) and Path(model).is_file()


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def model_dir(path: str | Path, cache: str | Path | None = None) -> Path:
    """The Hugging Face model dir of GGUF file `path`, built on first use (see the
    module's docstring)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} not found")
    digest = file_digest(path)
    out = Path(cache or cache_home()) / "gguf" / digest[:24]
    if (out / DONE).is_file():
        return out
    log.info("reading %s (GGUF) into a model dir at %s (once)", path, out)
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        _convert(path, tmp)
        (tmp / DONE).write_text(json.dumps({"source": str(path.resolve()), "sha256": digest}))
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.rename(out)
        except OSError:  # another process built it meanwhile (or a half-built one is there)
            if not (out / DONE).is_file():
                shutil.rmtree(out, ignore_errors=True)
                tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def describe(path: Path) -> tuple[str, list[str]]:
    """The architecture and the tensor types (quantizations) a GGUF file holds."""
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise GGUFError(f"{path} is a GGUF file; reading it needs the gguf package: "
                        "pip install 'yeto[gguf]'") from e
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, KeyError) as e:
        raise GGUFError(f"{path} is not a readable GGUF file: {e}") from None
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode("utf-8", "replace") if field else "?"
    kinds = sorted({t.tensor_type.name for t in reader.tensors})
    return arch, kinds


def _convert(path: Path, out: Path) -> None:
    """Dequantize `path` through transformers into `out` (config, float32 weights,
    tokenizer)."""
    arch, kinds = describe(path)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = dict(pretrained_model_name_or_path=str(path.parent), gguf_file=path.name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(**where)
        model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    except NotImplementedError as e:  # the gguf package's dequantizer has no such type
        raise GGUFError(f"{path}: its tensors are quantized as {', '.join(kinds)}, and one of "
                        f"them cannot be dequantized ({e}); use a file with another "
                        "quantization (Q4_0, Q4_1, Q8_0, the K-quants, F16 and BF16 are "
                        "read)") from None
    except (ValueError, KeyError) as e:
        raise GGUFError(f"{path}: transformers cannot read a {arch!r} model from GGUF ({e}); "
                        "convert it to a Hugging Face model dir another way") from None
    model.hf_quantizer = None  # dequantized already: save it as a plain float32 model
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    config_file = out / "config.json"
    config = json.loads(config_file.read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]  # where mlx-lm reads it
    config_file.write_text(json.dumps(config, indent=2))
