"""Loading a Hugging Face model dir with mlx-lm, whatever transformers wrote it.

One shim is needed with mlx-lm 0.32 and transformers 5:

- **rope_parameters.** transformers >= 5 writes ``rope_theta`` (and any RoPE
  scaling) nested under ``"rope_parameters"`` in ``config.json`` and no longer at
  the top level. mlx-lm's llama and qwen2 read only the flat ``rope_theta`` /
  ``rope_scaling`` and silently fall back to their own defaults (qwen2: 1e6,
  llama: 1e4) when those are missing, so the MLX model computes different logits
  than torch from the same weights (up to ~5 on the tiny qwen2 fixture).
  `flat_rope_overrides` lifts the nested values to the flat keys mlx-lm reads,
  before the model is built; a flat value already in the config wins.

Nothing else in mlx-lm 0.32.2 needs patching under transformers 5.x: the island
tokenizes with `transformers.AutoTokenizer` itself, so mlx-lm's tokenizer wrapper
is never in its path.

One adapter, not a patch: mlx-lm models take no attention-mask argument (they
build a causal mask from the KV cache), so `document_cache` hands a block-diagonal
causal mask in through the cache protocol for document-packed blocks (see
yeto.data). Positions stay 0..T-1 through the block: RoPE makes q·k depend only
on the distance between tokens, and with the mask tokens only meet tokens of their
own document, so this equals restarting positions at every document start (as the
torch island does with ``position_ids``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("yeto.mlx.shims")


def flat_rope_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """The flat RoPE keys mlx-lm reads, recovered from transformers-5
    ``rope_parameters`` (also inside ``text_config``). Empty when nothing is
    missing. Per-layer-type forms (``{"full_attention": {...}, ...}``) are left
    alone: the models that use them read ``rope_parameters`` themselves."""
    out: dict[str, Any] = {}
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        if config.get("rope_theta") is None:
            out["rope_theta"] = rope["rope_theta"]
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in (None, "default") and config.get("rope_scaling") is None:
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        if "partial_rotary_factor" in rope and config.get("partial_rotary_factor") is None:
            out["partial_rotary_factor"] = rope["partial_rotary_factor"]
    text = config.get("text_config")
    if isinstance(text, dict):
        inner = flat_rope_overrides(text)
        if inner:
            out["text_config"] = {**text, **inner}
    return out


def resolve_model_dir(model: str | Path) -> Path:
    """A local model dir, or a hub id already in the local Hugging Face cache."""
    path = Path(model)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(model), local_files_only=True))
    except Exception as e:  # noqa: BLE001 - any miss is the same error for the user
        raise FileNotFoundError(
            f"model {model!r} not found: pass a local Hugging Face model dir or a hub id "
            "that is already downloaded. Example: yeto make-tiny-model runs/tiny && "
            "python -m yeto.mlx.learner --model runs/tiny ...") from e


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """config.json as a dict (what `yeto.targets.select_targets` is given)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --model must be a Hugging Face model dir")
    return json.loads(path.read_text())


def load_model(model_dir: str | Path, *, lazy: bool = False, dtype: str | None = "float32"):
    """Build the mlx-lm model for a Hugging Face model dir, with the shims applied.

    Returns ``(model, config)``. The weights are cast to ``dtype`` (float32 by
    default, as the torch island loads them), so both islands compute the same
    function.
    """
    import mlx.core as mx
    from mlx_lm.utils import load_config
    from mlx_lm.utils import load_model as _load_model

    model_dir = resolve_model_dir(model_dir)
    overrides = flat_rope_overrides(load_config(model_dir))
    if overrides:
        log.debug("config shim: %s", overrides)
    model, config = _load_model(model_dir, lazy=lazy, model_config=overrides or None)
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
        if not lazy:
            mx.eval(model.parameters())
    return model, config


class MaskCache:
    """Stands in for an mlx-lm KV cache during one full-sequence forward pass: it
    caches nothing, and its ``make_mask`` returns the given mask (bool, True = may
    attend, broadcastable to (batch, heads, T, T))."""

    offset = 0

    def __init__(self, mask):
        self.mask = mask

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        import mlx.core as mx

        if self.mask.shape[-1] != n:
            raise ValueError(f"mask is for {self.mask.shape[-1]} tokens, the input has {n}")
        if window_size is not None and n > window_size:
            idx = mx.arange(n)
            return self.mask & ((idx[:, None] - idx[None, :]) < window_size)
        return self.mask

    def update_and_fetch(self, keys, values):
        return keys, values


def document_cache(model, mask) -> list[MaskCache]:
    """The ``cache=`` argument that makes an mlx-lm model attend with ``mask``."""
    return [MaskCache(mask) for _ in range(len(model.layers))]
