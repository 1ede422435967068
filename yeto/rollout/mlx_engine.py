"""The MLX rollout engine: the MLX island's model (mlx-lm with yeto's peft-shaped
`LoRALinear`, float32), sampled with mlx-lm's KV caches.

Each prompt is prefilled alone into the caches mlx-lm makes for the model; a batch
is merged the way mlx-lm's own batched generation merges them: `KVCache` into
`BatchKVCache` (left padding, masked; RoPE offsets per row), and the conv and
recurrent states of hybrid models (`ArraysCache`: LFM2's short convs, mamba
blocks, gated-delta blocks) stacked as each prompt alone left them, so no padded
position passes through a convolution or a state update. Imports no torch."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from yeto.rollout.adapters import LoraSpec
from yeto.rollout.engine import LoRAEngine


class MLXEngine(LoRAEngine):
    name = "mlx"

    def __init__(self, model_dir: str | Path, spec: LoraSpec = LoraSpec(), *,
                 seed: int = 0, tokenizer=None):
        super().__init__(model_dir, spec, seed)
        import mlx.core as mx

        from yeto.mlx.load import load_model, read_config

        mx.random.seed(seed)
        self.model, _ = load_model(self.model_dir)
        self.hf_config = read_config(self.model_dir)
        self.layers: dict = {}
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.tokenizer = tokenizer
        check_batchable(self.model)
        self.attach(spec)

    @classmethod
    def wrap(cls, model, tokenizer, model_dir: str | Path) -> MLXEngine:
        """An engine over a model it does not own (no LoRA of its own, no weights view):
        for sampling from e.g. a training model in the same process."""
        from yeto.mlx.load import read_config

        self = cls.__new__(cls)
        LoRAEngine.__init__(self, model_dir, LoraSpec())
        self.model, self.tokenizer, self.layers = model, tokenizer, {}
        self.hf_config = read_config(self.model_dir)
        return self

    def _attach(self, spec: LoraSpec):
        from mlx.utils import tree_unflatten

        from yeto.mlx.hf_paths import hf_weight_names
        from yeto.mlx.lora import LoRAWeights, attach_lora

        if self.layers:  # a LoRA already: put the base linears back first
            self.model.update_modules(tree_unflatten(
                [(p, layer.base_layer) for p, layer in self.layers.items()]))
        self.layers = attach_lora(self.model, self.hf_config, spec.r, spec.alpha, spec.targets,
                                  self.seed, hf_weight_names=hf_weight_names(self.model_dir))
        return LoRAWeights(self.layers)

    @property
    def max_len(self) -> int:
        cfg = self.hf_config.get("text_config") or self.hf_config
        return int(cfg.get("max_position_embeddings") or 1 << 30)

    @property
    def vocab_size(self) -> int:
        cfg = self.hf_config.get("text_config") or self.hf_config
        return int(cfg["vocab_size"])

    def prefill(self, prompt: Sequence[int]):
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        logits = self.model(mx.array([list(prompt)]), cache=cache)[0, -1].astype(mx.float32)
        mx.eval(logits, [c.state for c in cache])
        return cache, np.array(logits)

    def merge(self, caches: list):
        return [_merge_layer([c[i] for c in caches], i) for i in range(len(caches[0]))]

    def decode(self, state, tokens: np.ndarray) -> np.ndarray:
        import mlx.core as mx

        logits = self.model(mx.array(tokens.astype(np.int32))[:, None], cache=state)
        last = logits[:, -1].astype(mx.float32)
        mx.eval(last)
        return np.array(last)

    def filter(self, state, keep: list[int]):
        import mlx.core as mx

        idx = mx.array(keep)
        for c in state:
            c.filter(idx)
        return state


def _exact(c) -> bool:
    """Whether merging caches like `c` is exact (see the module's docstring)."""
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache

    if isinstance(c, CacheList):
        return all(_exact(part) for part in c.caches)
    return type(c) in (KVCache, ArraysCache)


def check_batchable(model) -> None:
    """Refuse (ValueError) a model whose caches the engine cannot batch exactly."""
    from mlx_lm.models.cache import make_prompt_cache

    for i, c in enumerate(make_prompt_cache(model)):
        if not _exact(c):
            raise ValueError(
                f"this model cannot be sampled in batches on MLX yet: layer {i} keeps a "
                f"{type(c).__name__} (batched are full-attention KV caches and conv / "
                f"state-space states, not sliding windows); serve it with another engine "
                f"(e.g. vLLM)")


def _merge_layer(rows: list, i: int):
    """Layer `i`'s cache of a batch, from that layer's cache of each row."""
    from mlx_lm.models.cache import BatchKVCache, KVCache

    if not _exact(rows[0]):
        raise ValueError(f"layer {i}: a {type(rows[0]).__name__} cannot be batched yet")
    if isinstance(rows[0], KVCache):
        return BatchKVCache.merge(rows)
    return type(rows[0]).merge(rows)
