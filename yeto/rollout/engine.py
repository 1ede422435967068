"""What both rollout engines share: the LoRA they hold (as the island's flat view,
`weights`), adapters loaded in either format, and the stop tokens of the model.

A backend subclasses `LoRAEngine` and provides `_attach(spec)` (replace the LoRA
on the base model and return its `yeto.island.Weights` view) and the four calls of
`yeto.rollout.generate.Engine`."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from yeto import gguf
from yeto.rollout.adapters import AdapterError, LoraSpec, flat_of, read_adapter

log = logging.getLogger("yeto.rollout")

PROBE_TOKENS = 8  # the input a newly loaded adapter must give finite logits on


def stop_token_ids(model_dir: str | Path, tokenizer) -> list[int]:
    """End-of-sequence ids: generation_config.json's ``eos_token_id`` (one or a list)
    and the tokenizer's eos token (vLLM stops on both)."""
    ids: set[int] = set()
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(int(i) for i in ids)


class LoRAEngine:
    """The backend-free half of an engine. Call `_attach` from the subclass's
    constructor; `weights` is then the flat float32 view under canonical names."""

    name = "?"

    def __init__(self, model_dir: str | Path, spec: LoraSpec, seed: int = 0):
        # a .gguf file: the model dir it was read into (yeto.gguf)
        self.model_dir = gguf.model_dir(model_dir) if gguf.is_gguf(model_dir) else Path(model_dir)
        self.seed = seed
        self.spec = spec
        self.weights = None

    def attach(self, spec: LoraSpec) -> None:
        self.weights = self._attach(spec)
        self.spec = spec

    def _attach(self, spec: LoraSpec):
        raise NotImplementedError

    @property
    def layout(self):
        return self.weights.layout

    def set_weights(self, flat: np.ndarray) -> None:
        self.weights.set(flat)

    def load_adapter(self, path: str | Path, fixed_layout: bool = False) -> str:
        """Load a peft or mlx-lm adapter; returns its format. The LoRA is rebuilt when
        the adapter's shape differs, unless `fixed_layout` (a node in a run: its layout
        is the run's), which refuses such an adapter instead. The loaded model must
        give finite logits on a probe input (`check_logits`). An adapter refused
        (`AdapterError`) leaves the engine serving what it served before."""
        tensors, spec, kind = read_adapter(path, self.model_dir)
        old_spec, old_flat = self.spec, self.weights.get()
        self._put(tensors, spec, path, fixed_layout)
        try:
            self.check_logits(path)
        except AdapterError:
            if self.spec != old_spec:  # rebuilt for the adapter: the old LoRA back
                self.attach(old_spec)
            self.set_weights(old_flat)
            raise
        return kind

    def check_logits(self, path) -> None:
        """Refuse (`AdapterError`) the adapter just put in place, loaded from `path`,
        when the model's logits on a short probe input are NaN or infinite: finite
        factors and scale can still overflow the model's activations."""
        vocab = self.vocab_size
        probe = [(3 + 7919 * i) % vocab for i in range(PROBE_TOKENS)]  # spread over the vocab
        _, logits = self.prefill(probe)
        if not np.isfinite(logits).all():
            raise AdapterError(f"the adapter at {path} makes this model's logits NaN or infinite "
                               f"on a {PROBE_TOKENS}-token probe input (its values or LoRA scale "
                               "overflow the model's activations); it would sample garbage: fix "
                               "or retrain it")

    def _put(self, tensors: dict[str, np.ndarray], spec: LoraSpec, path,
             fixed_layout: bool) -> None:
        """Put the adapter's `tensors` in place (rebuilding the LoRA for `spec` where
        it differs, unless `fixed_layout`)."""
        same_scale = abs(spec.alpha / spec.r - self.spec.alpha / self.spec.r) < 1e-12
        try:
            flat = flat_of(tensors, self.layout)
        except AdapterError:
            flat = None
        if flat is None or not same_scale:
            if fixed_layout:
                raise AdapterError(f"the adapter at {path} (r={spec.r}, alpha={spec.alpha}) does "
                                   "not fit this node's LoRA, which is fixed by the run it "
                                   "observes; load an adapter of the run's shape")
            self._rebuild(spec, tensors, path)
        else:
            self.set_weights(flat)

    def _rebuild(self, spec: LoraSpec, tensors: dict[str, np.ndarray], path) -> None:
        """Attach the LoRA of `spec` and load `tensors` into it; on failure, the LoRA
        and weights from before are put back and `AdapterError` says why."""
        old_spec, old_flat = self.spec, self.weights.get()
        log.info("rebuilding LoRA for the adapter: r=%d alpha=%g", spec.r, spec.alpha)
        try:
            self.attach(spec)
            self.set_weights(flat_of(tensors, self.layout))
        except Exception as e:
            self.attach(old_spec)
            self.set_weights(old_flat)
            if isinstance(e, AdapterError):
                raise
            if isinstance(e, (ValueError, KeyError, RuntimeError, TypeError)):
                raise AdapterError(f"the adapter at {path} does not fit this model: {e}") from e
            raise
