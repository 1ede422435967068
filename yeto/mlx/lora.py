"""peft-exact LoRA in MLX.

`LoRALinear` mirrors peft's ``lora.Linear`` rather than mlx-lm's transposed layer:

    lora_A: nn.Linear(in, r), weight (r, in), peft's init: kaiming-uniform with
            a=sqrt(5), i.e. uniform(-1/sqrt(in), 1/sqrt(in))
    lora_B: nn.Linear(r, out), weight (out, r), zeros
    y = base_layer(x) + lora_B(lora_A(x)) * (alpha / r)

so a module at Hugging Face path ``model.layers.0.self_attn.q_proj`` holds
parameters ``...q_proj.lora_A.weight`` / ``...q_proj.lora_B.weight`` whose
canonical names (``yeto.targets.peft_key``) and shapes are exactly peft's, and the
flat vector (`LoRAWeights`) is in `yeto.layout` canonical order: names alone
decide fragments, as on the torch island. `LoRAWeights` is also the view
`MLXDiLoCo` takes of an mlx-lm model with mlx-lm's own (transposed) LoRA layers.

Which linears get LoRA is decided by `yeto.targets.select_targets` from the
Hugging Face config, the same call the torch island makes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from yeto.layout import Layout
from yeto.targets import peft_key, select_targets


class LoRALinear(nn.Module):
    """A frozen linear plus a peft-shaped low-rank update (no dropout: the islands
    train with lora_dropout=0)."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, key: mx.array | None = None):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"LoRALinear wraps mlx.nn.Linear, got {type(base).__name__}; "
                            "quantized MLX models are not supported (the island trains on the "
                            "same float32 base as the torch island)")
        if r < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {r}")
        out_dims, in_dims = base.weight.shape
        base.freeze()
        self.base_layer = base
        self.lora_A = nn.Linear(in_dims, r, bias=False)
        self.lora_B = nn.Linear(r, out_dims, bias=False)
        bound = 1.0 / math.sqrt(in_dims)  # kaiming_uniform_(a=sqrt(5)) on an (r, in) weight
        self.lora_A.weight = mx.random.uniform(-bound, bound, (r, in_dims), key=key)
        self.lora_B.weight = mx.zeros((out_dims, r))
        self.r = int(r)
        self.alpha = float(alpha)
        self.scaling = self.alpha / self.r

    @property
    def in_features(self) -> int:
        return int(self.lora_A.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.lora_B.weight.shape[0])

    def __call__(self, x: mx.array) -> mx.array:
        # peft: result = base_layer(x); result = result + lora_B(lora_A(dropout(x))) * scaling
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling


def get_module(model: nn.Module, path: str) -> nn.Module:
    m = model
    for part in path.split("."):
        m = m[int(part)] if isinstance(m, list) else m[part]
    return m


def linear_paths(model: nn.Module) -> list[str]:
    """Module paths of the model's plain linears (the MLX module tree uses the
    Hugging Face module paths for the supported architectures)."""
    return [p for p, m in model.named_modules() if p and isinstance(m, nn.Linear)]


def _quantized_in_blocks(model: nn.Module) -> list[str]:
    return [p for p, m in model.named_modules()
            if ".layers." in f".{p}" and isinstance(m, nn.QuantizedLinear)]


def attach_lora(model: nn.Module, config: dict, r: int, alpha: float, targets: str = "auto",
                seed: int = 0, hf_weight_names: Iterable[str] | None = None,
                ) -> dict[str, LoRALinear]:
    """Freeze the model and wrap the selected linears in `LoRALinear`.

    ``config`` is the Hugging Face config dict (config.json); ``targets`` is the
    ``--lora-targets`` value. With ``hf_weight_names`` (the checkpoint's tensor
    names), every chosen MLX module path is checked to be the Hugging Face module
    path too, so the canonical peft names are right. Returns {module path: layer}.
    """
    quantized = _quantized_in_blocks(model)
    if quantized:
        raise ValueError(f"the MLX model has quantized linears (e.g. {quantized[0]}); load the "
                         "float32/bf16 Hugging Face checkpoint instead of an MLX-quantized one")
    model.freeze()
    chosen = select_targets(linear_paths(model), targets, config)
    if hf_weight_names is not None:
        names = set(hf_weight_names)
        missing = [p for p in chosen if f"{p}.weight" not in names]
        if missing:
            raise ValueError(
                f"MLX module {missing[0]} has no Hugging Face weight {missing[0]}.weight: "
                "mlx-lm's module tree for this architecture differs from the Hugging Face "
                "one, so canonical peft names cannot be derived; check with "
                "scripts/check_name_parity.py --model ...")
    keys = mx.random.split(mx.random.key(seed), len(chosen))
    layers = {p: LoRALinear(get_module(model, p), r, alpha, key=keys[i])
              for i, p in enumerate(chosen)}
    model.update_modules(tree_unflatten(list(layers.items())))
    mx.eval([(x.lora_A.weight, x.lora_B.weight) for x in layers.values()])
    return layers


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """{module path: LoRALinear} of a model with LoRA attached."""
    return {p: m for p, m in model.named_modules() if isinstance(m, LoRALinear)}


_PEFT_PREFIX = "base_model.model."


def canonical_mlx_name(name: str) -> tuple[str, bool]:
    """(canonical name, transposed) of a trainable MLX parameter path.

    yeto's `LoRALinear` holds peft's shapes: ``<m>.lora_A.weight`` (r, in) is
    ``base_model.model.<m>.lora_A.weight`` as is. mlx-lm's LoRA layer holds them
    transposed: ``<m>.lora_a`` (in, r) is that name's transpose, ``<m>.lora_b``
    (r, out) is ``...lora_B.weight``'s. Any other parameter keeps its (Hugging Face)
    name, as in full fine-tuning."""
    for suffix in (".lora_A.weight", ".lora_B.weight"):
        if name.endswith(suffix):
            return peft_key(name[:-len(suffix)], suffix[1:-len(".weight")]), False
    for suffix, which in ((".lora_a", "lora_A"), (".lora_b", "lora_B")):
        if name.endswith(suffix):
            return peft_key(name[:-len(suffix)], which), True
    return name, False


def _walk(root, parts: list[str]):
    for part in parts:
        root = root[int(part)] if isinstance(root, list) else root[part]
    return root


class _Slot:
    """Where one trainable array lives: ``owner[key]``, and how it maps to its
    canonical tensor (transposed or not; the array's own dtype)."""

    def __init__(self, root, path: str, transpose: bool):
        *parents, self.key = path.split(".")
        self.owner = _walk(root, parents)
        if isinstance(self.owner, list):
            self.key = int(self.key)
        self.transpose = transpose
        self.dtype = self.owner[self.key].dtype
        # the LoRA layer (for its rank and scale): mlx-lm's owns lora_a itself, yeto's
        # owns the lora_A Linear that owns the weight
        self.lora_layer = _walk(root, parents[:-1] if path.endswith(".weight") else parents)

    def read(self) -> mx.array:
        return self.owner[self.key]

    def write(self, a: np.ndarray) -> None:
        arr = mx.array(np.ascontiguousarray(a.T if self.transpose else a))
        self.owner[self.key] = arr if self.dtype == mx.float32 else arr.astype(self.dtype)


class LoRAWeights:
    """An MLX model's trainable weights under canonical peft names, as one flat
    float32 vector in `yeto.layout` canonical order (the island's view of the model).

    ``source`` is either ``{module path: LoRALinear}`` (what `attach_lora` returns;
    the MLX island) or a model whose trainable parameters are the weights: yeto's
    `LoRALinear` layers, mlx-lm's (``linear_to_lora_layers``; their transposed
    ``lora_a``/``lora_b`` are seen as peft's ``lora_A``/``lora_B``), and any other
    unfrozen parameter under its own name (see `canonical_mlx_name`). Arrays keep
    their dtype when set."""

    def __init__(self, source: dict[str, LoRALinear] | nn.Module):
        self._slots: dict[str, _Slot] = {}
        if isinstance(source, nn.Module):
            for name, _ in tree_flatten(source.trainable_parameters()):
                canonical, transpose = canonical_mlx_name(name)
                self._slots[canonical] = _Slot(source, name, transpose)
        else:
            for path, layer in source.items():
                for which in ("lora_A", "lora_B"):
                    self._slots[peft_key(path, which)] = _Slot(layer, f"{which}.weight", False)
        if not self._slots:
            raise ValueError("no trainable weights: attach LoRA first (yeto.mlx.lora.attach_lora, "
                             "or mlx_lm.tuner.utils.linear_to_lora_layers after model.freeze())")
        self._shapes = {k: tuple(s.read().shape[::-1] if s.transpose else s.read().shape)
                        for k, s in self._slots.items()}
        self.layout = Layout.from_shapes(self._shapes)
        self._ordered = [self._slots[spec.name] for spec in self.layout.specs]

    def get(self) -> np.ndarray:
        arrays = [s.read() for s in self._ordered]
        mx.eval(arrays)
        parts = []
        for s, a in zip(self._ordered, arrays):
            a = np.asarray(a if a.dtype == mx.float32 else a.astype(mx.float32))
            parts.append((a.T if s.transpose else a).reshape(-1))
        return np.concatenate(parts).astype(np.float32, copy=False)

    def set(self, flat: np.ndarray) -> None:
        flat = np.asarray(flat, dtype=np.float32)
        if flat.shape != (self.layout.numel,):
            raise ValueError(f"flat vector has {flat.size} elements, layout has "
                             f"{self.layout.numel}")
        for spec, s in zip(self.layout.specs, self._ordered):
            lo, hi = self.layout.offsets[spec.name]
            s.write(flat[lo:hi].reshape(spec.shape))
        mx.eval([s.read() for s in self._ordered])

    def tensors(self) -> dict[str, np.ndarray]:
        """Canonical name -> float32 array (copies), e.g. to save a peft adapter."""
        return {k: v.copy() for k, v in self.layout.unflatten(self.get()).items()}

    def lora_config(self) -> tuple[int, float, list[str]] | None:
        """(r, scale = alpha / r, adapted module paths) when every weight is a LoRA
        factor and all share one rank and one scale (what an adapter_config.json can
        say), else None."""
        modules: dict[str, _Slot] = {}
        for name, s in self._slots.items():
            if not name.endswith(".lora_A.weight") and not name.endswith(".lora_B.weight"):
                return None
            modules[name[len(_PEFT_PREFIX):-len(".lora_A.weight")]] = s
        if len(modules) * 2 != len(self._slots):
            return None
        ranks = {self._shapes[peft_key(m, "lora_A")][0] for m in modules}
        scales = {float(getattr(s.lora_layer, "scaling", getattr(s.lora_layer, "scale", 0.0)))
                  for s in modules.values()}
        if len(ranks) != 1 or len(scales) != 1:
            return None
        return ranks.pop(), scales.pop(), sorted(modules)
