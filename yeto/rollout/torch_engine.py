"""The torch rollout engine: a Hugging Face causal LM with peft LoRA (the torch
island's `yeto.torch.model`), sampled with transformers' `DynamicCache`.

Each prompt is prefilled alone; a batch's caches are then merged
(`yeto.rollout.torch_cache`: keys and values left-padded with zeros that the
attention mask hides, the conv and recurrent states of hybrid models such as LFM2
stacked as each prompt left them), and decoded one token per row per step with
per-row positions. The engine also wraps a model it does not own
(`TorchEngine.wrap`): the GRPO island evaluates its own weights this way."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from yeto.rollout import torch_cache
from yeto.rollout.adapters import LoraSpec
from yeto.rollout.engine import LoRAEngine


@dataclass
class _Batch:
    cache: object            # transformers DynamicCache, batch of rows
    mask: torch.Tensor | None  # (B, length) 1 = real key, 0 = padding; None: no keys
    #                            (state-space models, whose layers would misread it)
    pos: torch.Tensor        # (B,) position of each row's next token


class TorchEngine(LoRAEngine):
    name = "torch"

    def __init__(self, model_dir: str | Path, spec: LoraSpec = LoraSpec(), *,
                 device: str = "cpu", seed: int = 0, base=None, tokenizer=None):
        super().__init__(model_dir, spec, seed)
        from yeto.torch.model import load_base

        if base is None:
            base, tokenizer = load_base(str(model_dir))
        self.device = torch.device(device)
        self.tokenizer = tokenizer
        self.model = base.to(self.device).eval()
        torch_cache.new_cache(base.config)  # refuses a model it cannot batch, up front
        self.attach(spec)

    @classmethod
    def wrap(cls, model, tokenizer, model_dir: str | Path) -> TorchEngine:
        """An engine over a model it does not own (no LoRA of its own, no weights view):
        for sampling from e.g. a training model in the same process."""
        self = cls.__new__(cls)
        LoRAEngine.__init__(self, model_dir, LoraSpec())
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        return self

    def _attach(self, spec: LoraSpec):
        from yeto.torch.model import attach_lora
        from yeto.torch.weights import TorchWeights

        base = self.model
        if hasattr(base, "peft_config"):  # a LoRA already: back to the bare base model
            base = base.unload()
        self.model = attach_lora(base, spec.r, spec.alpha, spec.targets, self.seed).eval()
        weights = TorchWeights(self.model, "lora")  # picks the LoRA tensors (trainable now)
        for p in self.model.parameters():
            p.requires_grad_(False)  # a node never trains; the view keeps its tensors
        return weights

    @property
    def _lm(self):
        m = self.model
        return m.get_base_model() if hasattr(m, "get_base_model") else m

    @property
    def max_len(self) -> int:
        return int(getattr(self._lm.config, "max_position_embeddings", 0) or 1 << 30)

    @property
    def vocab_size(self) -> int:
        return int(self._lm.config.get_text_config().vocab_size)

    @torch.inference_mode()
    def prefill(self, prompt: Sequence[int]):
        cache = torch_cache.new_cache(self._lm.config)
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=self.device)
        out = self._lm(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        return (cache, len(prompt)), out.logits[0, -1].float().cpu().numpy()

    @torch.inference_mode()
    def merge(self, caches: list) -> _Batch:
        cache = torch_cache.merge([c for c, _ in caches], [n for _, n in caches])
        lengths = torch.tensor([n for _, n in caches], device=self.device)
        length = int(lengths.max())
        mask = (torch.arange(length, device=self.device)[None, :]
                >= (length - lengths)[:, None]).long()
        return _Batch(cache, mask if torch_cache.has_keys(cache) else None, lengths.clone())

    @torch.inference_mode()
    def decode(self, state: _Batch, tokens: np.ndarray) -> np.ndarray:
        ids = torch.from_numpy(tokens).long().to(self.device)[:, None]
        if state.mask is not None:
            ones = torch.ones(ids.shape[0], 1, dtype=state.mask.dtype, device=self.device)
            state.mask = torch.cat([state.mask, ones], dim=1)
        out = self._lm(input_ids=ids, attention_mask=state.mask, position_ids=state.pos[:, None],
                       cache=state.cache, use_cache=True)
        state.pos = state.pos + 1
        return out.logits[:, -1].float().cpu().numpy()

    def filter(self, state: _Batch, keep: list[int]) -> _Batch:
        idx = torch.tensor(keep, device=self.device)
        torch_cache.select(state.cache, idx)
        state.mask = None if state.mask is None else state.mask[idx]
        state.pos = state.pos[idx]
        return state
