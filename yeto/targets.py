"""Which linears get LoRA: one rule for the torch and MLX islands.

Both backends list their linear modules under Hugging Face module paths
(`model.layers.0.self_attn.q_proj`), and this module picks the same ones from
the model's config, so both islands adapt the same linears and produce the same
canonical names.
"""

from __future__ import annotations

import re

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
MLP = ("gate_proj", "up_proj", "down_proj", "gate_up_proj", "fc1", "fc2")
TARGET_MODES = ("auto", "attention", "all-linear")
_IN_BLOCK = re.compile(r"(^|\.)layers\.\d+\.")
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def is_moe(config: dict) -> bool:
    return any((config.get(k) or 0) > 1 for k in _MOE_KEYS)


def target_leaves(mode: str, config: dict) -> tuple[str, ...]:
    """Leaf names to adapt. `auto` = all-linear for dense models (LoRA on every
    linear learns most per parameter), attention only for MoE models (adapting
    every expert multiplies the adapter size). A comma list picks leaves by name."""
    if mode == "auto":
        mode = "attention" if is_moe(config) else "all-linear"
    if mode == "attention":
        return ATTENTION
    if mode == "all-linear":
        return ATTENTION + MLP
    leaves = tuple(x.strip() for x in mode.split(",") if x.strip())
    if not leaves:
        raise ValueError(f"--lora-targets {mode!r}: use auto, attention, all-linear or a comma "
                         "list of module names, e.g. --lora-targets q_proj,v_proj")
    return leaves


def select_targets(linear_paths, mode: str, config: dict) -> list[str]:
    """Module paths (inside decoder blocks) of the linears to adapt, sorted."""
    leaves = target_leaves(mode, config)
    chosen = sorted(p for p in linear_paths
                    if _IN_BLOCK.search(p) and p.rsplit(".", 1)[-1] in leaves
                    and ".mlp.experts." not in p)
    if not chosen:
        raise ValueError(f"--lora-targets {mode!r} matched no linear layer in the model's "
                         f"decoder blocks (looked for {', '.join(leaves)}); pass module names "
                         "explicitly, e.g. --lora-targets q_proj,v_proj")
    return chosen


def peft_key(module_path: str, which: str) -> str:
    """Canonical name of a LoRA factor: peft's saved key (no adapter name)."""
    return f"base_model.model.{module_path}.{which}.weight"
