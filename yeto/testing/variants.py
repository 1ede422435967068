"""Other valid configs of an architecture than the `yeto.testing.archs` preset.

`draw` returns overrides for `yeto.testing.archs.tiny_config`, drawn from a seed over
what the architecture's config has: the layer count and, for hybrids, every per-layer
list (``layer_types`` with one kind only or any interleaving, ``mlp_layer_types``, ...),
attention heads, key/value heads, head and hidden widths, MLP widths that are not a
fixed multiple of the hidden size, the RoPE variant transformers writes (default,
linear, dynamic, yarn, llama3, longrope; theta; partial rotation), bias switches and
tied or untied embeddings. `valid_variant` keeps the first draw that transformers
builds and runs (a forward pass), trying draws that change less after failures.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from yeto.interop.parity import LAYER_COUNTS

HEADS = (2, 4, 8)
HEAD_DIMS = (8, 16, 32)
HIDDEN = (32, 48, 64, 96)
MLP_WIDTHS = (40, 72, 88, 136, 168)        # not a fixed multiple of any HIDDEN
EXPERT_WIDTHS = (24, 40, 56)
ROPE_THETAS = (10000.0, 500000.0, 1000000.0)
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
TRIES = 8


def _rng(arch: str, seed: int, index: int, attempt: int) -> np.random.Generator:
    return np.random.default_rng([seed, index, attempt, zlib.crc32(arch.encode())])


def _pick(rng, values):
    return values[int(rng.integers(len(values)))]


def _layer_lists(c: dict, rng, out: dict, desc: list[str]) -> None:
    """A new layer count, and every per-layer list redrawn for it: one kind only (a
    third of the time) or each layer drawn from the kinds the preset has."""
    key = next((k for k in LAYER_COUNTS if isinstance(c.get(k), int)), None)
    if key is None:
        return
    old = c[key]
    n = int(rng.integers(2, 7))
    out[key] = n
    desc.append(f"layers={n}")
    for name, value in c.items():
        if not (isinstance(value, list) and len(value) == old and value):
            continue
        if name.endswith("layers") and all(isinstance(v, int) for v in value) \
                and value == sorted(set(value)):  # layer indices (llama4's moe_layers)
            out[name] = sorted(int(i) for i in rng.choice(n, int(rng.integers(n + 1)),
                                                          replace=False))
            desc.append(f"{name}={out[name]}")
            continue
        kinds = sorted({repr(v) for v in value})
        if len(kinds) > 1 and rng.random() < 1 / 3:
            kinds = [_pick(rng, kinds)]
        drawn = [eval(_pick(rng, kinds)) for _ in range(n)]  # noqa: S307 - our own repr()s
        out[name] = drawn
        if name.endswith("layer_types"):
            desc.append(f"{name}={''.join(str(t)[0] for t in drawn)}")


def _widths(c: dict, rng, out: dict, desc: list[str]) -> None:
    heads = _pick(rng, HEADS)
    hd = _pick(rng, HEAD_DIMS)
    for k in ("num_attention_heads", "n_head", "n_heads"):
        if isinstance(c.get(k), int):
            out[k] = heads
    kv = _pick(rng, [d for d in (1, 2, 4, 8) if heads % d == 0])
    for k in ("num_key_value_heads", "kv_n_heads"):
        if isinstance(c.get(k), int) and c.get(k) != c.get("num_attention_heads"):
            out[k] = kv
    if isinstance(c.get("head_dim"), int):
        out["head_dim"] = hd
        hidden = _pick(rng, HIDDEN)
    else:
        hidden = heads * hd
    for k in ("hidden_size", "n_embd", "d_model"):
        if isinstance(c.get(k), int):
            out[k] = hidden
    ffn = _pick(rng, MLP_WIDTHS)
    for k in ("intermediate_size", "n_inner", "ffn_hidden_size"):
        if isinstance(c.get(k), int):
            out[k] = ffn
    for k in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if isinstance(c.get(k), int):
            out[k] = _pick(rng, EXPERT_WIDTHS)
    desc.append(f"heads={heads}/{out.get('num_key_value_heads', '-')} head_dim={hd} "
                f"hidden={hidden} mlp={ffn}")


def _rope_params(kind: str, theta: float, c: dict, rotary: int) -> dict[str, Any]:
    p: dict[str, Any] = {"rope_type": kind, "rope_theta": theta}
    orig = max(8, int(c.get("max_position_embeddings") or 256) // 4)
    if kind in ("linear", "dynamic"):
        p["factor"] = 2.0
    elif kind == "yarn":
        p.update(factor=4.0, original_max_position_embeddings=orig)
    elif kind == "llama3":
        p.update(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                 original_max_position_embeddings=orig)
    elif kind == "longrope":
        p.update(short_factor=[1.0 + 0.05 * i for i in range(rotary // 2)],
                 long_factor=[1.5 + 0.1 * i for i in range(rotary // 2)],
                 original_max_position_embeddings=orig)
    return p


def _rope(c: dict, out: dict, rng, desc: list[str]) -> None:
    rope = c.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        return  # no RoPE, or per layer type (the preset's kept)
    kind = _pick(rng, ROPE_TYPES)
    theta = _pick(rng, ROPE_THETAS)
    head = out.get("head_dim") or c.get("head_dim") or (
        (out.get("hidden_size") or c.get("hidden_size") or 64)
        // (out.get("num_attention_heads") or c.get("num_attention_heads") or 4))
    factor = rope.get("partial_rotary_factor")
    params = _rope_params(kind, theta, c, int(head * (factor or 1.0)))
    if factor is not None:
        params["partial_rotary_factor"] = factor
    out["rope_parameters"] = params
    desc.append(f"rope={kind}")


def _switches(c: dict, rng, out: dict, desc: list[str]) -> None:
    for k, v in c.items():
        if isinstance(v, bool) and "bias" in k and rng.random() < 0.5:
            out[k] = not v
            desc.append(f"{k}={not v}")


def draw(arch: str, seed: int, index: int, attempt: int = 0) -> tuple[dict, str]:
    """(overrides for `tiny_config`, a one-line description) of variant ``index``;
    ``attempt`` >= 3 keeps the preset widths, >= 6 also its layers, 7 also its RoPE."""
    from yeto.testing.archs import tiny_config

    base = tiny_config(arch).to_dict()
    nested = isinstance(base.get("text_config"), dict)
    c = base["text_config"] if nested else base
    rng = _rng(arch, seed, index, attempt)
    out: dict[str, Any] = {}
    desc: list[str] = []
    if attempt < 6:
        _layer_lists(c, rng, out, desc)
    if attempt < 3:
        _widths(c, rng, out, desc)
    if attempt < 7:
        _rope(c, out, rng, desc)
    _switches(c, rng, out, desc)
    top = {"text_config": out} if nested else out
    if isinstance(base.get("tie_word_embeddings"), bool) and rng.random() < 0.5:
        top["tie_word_embeddings"] = not base["tie_word_embeddings"]
        desc.append(f"tied={not base['tie_word_embeddings']}")
    return top, " ".join(desc) or "preset"


def runs(arch: str, overrides: dict) -> str | None:
    """None when transformers builds the config and its model runs a forward pass,
    else why not."""
    import torch
    from transformers import AutoModelForCausalLM

    from yeto.testing.archs import tiny_config

    try:
        config = tiny_config(arch, overrides)
        torch.manual_seed(0)
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        except ImportError:  # as tiny_model does: the text model of an image-text config
            config = config.get_text_config()
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        vocab = getattr(config, "vocab_size", None) or config.get_text_config().vocab_size
        with torch.no_grad():
            model(input_ids=torch.randint(0, vocab, (1, 8)))
    except Exception as e:  # noqa: BLE001 - any failure makes the draw invalid
        return f"{type(e).__name__}: {str(e)[:120]}"
    return None


def valid_variant(arch: str, seed: int, index: int) -> tuple[dict, str, int]:
    """(overrides, description, attempt) of the first of `TRIES` draws transformers
    builds and runs; raises ValueError naming the last failure when none does."""
    why = ""
    for attempt in range(TRIES):
        overrides, desc = draw(arch, seed, index, attempt)
        why = runs(arch, overrides)
        if why is None:
            return overrides, desc, attempt
    raise ValueError(f"no valid {arch} config in {TRIES} draws (last: {why})")
