"""Frozen LoRA A factors drawn from a shared seed (the frozen-A merge mode).

Averaging lora_A and lora_B separately is biased: the mean of the products BᵢAᵢ
is not the product of the means. With A frozen to the same matrix on every
island, ΔW = (Σ wᵢBᵢ / Σ wᵢ)·A exactly, and only B travels (half the bytes).
A is generated here in numpy from (seed, tensor name), so the torch island, the
MLX island and the syncer (which writes A into its final adapter) all produce the
same bits without sending them.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

EXPORT_FILE = "yeto_frozen_a.json"  # sent with the join so the syncer can rebuild A


def frozen_lora_a(name: str, shape: tuple[int, int], seed: int) -> np.ndarray:
    """peft's default init bound for lora_A (kaiming-uniform, a=√5): U(±1/√in)."""
    digest = hashlib.sha256(f"{seed}|{name}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    bound = 1.0 / np.sqrt(shape[1])
    return rng.uniform(-bound, bound, size=shape).astype(np.float32)


def describe(seed: int, shapes: dict[str, tuple[int, int]]) -> str:
    return json.dumps({"seed": seed, "tensors": {k: list(v) for k, v in sorted(shapes.items())}})


def rebuild(text: str) -> dict[str, np.ndarray]:
    spec = json.loads(text)
    return {name: frozen_lora_a(name, tuple(shape), int(spec["seed"]))
            for name, shape in spec["tensors"].items()}


def run_adapter_tensors(tensors: dict[str, np.ndarray],
                        export_files: dict[str, str]) -> dict[str, np.ndarray]:
    """A run's adapter tensors from its merged weights: the synced tensors plus, for a
    frozen-A run (`EXPORT_FILE` among the files the islands sent), every lora_A
    rebuilt from the shared seed, the same bits the islands trained with. What the
    syncer writes into ``final/`` and `yeto export` writes for a run in progress."""
    out = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    if EXPORT_FILE in export_files:  # frozen-A mode: A never travelled
        out.update(rebuild(export_files[EXPORT_FILE]))
    return out
