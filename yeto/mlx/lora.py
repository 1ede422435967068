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

Fused mixture-of-experts weights (mlx-lm's ``SwitchLinear``) get
`yeto.mlx.experts.ExpertLoRA`, in the layout of peft's ``ParamWrapper``.

Which linears get LoRA is decided by `yeto.targets.select_targets` from the
Hugging Face config and the Hugging Face module paths, the same call the torch
island makes. mlx-lm's module tree is not always the Hugging Face one (gpt2's
``transformer.h.N`` is ``model.h.N``, gpt_neox's ``gpt_neox.layers.N`` is
``model.h.N``, gpt2's ``Conv1D`` weights are transposed into ``nn.Linear``, some
weights are split or fused): `yeto.mlx.hf_paths` finds, for every MLX linear,
the checkpoint tensor it was loaded from by replaying the model's own
``sanitize`` on marker arrays, and canonical names always use the Hugging Face
path. A chosen
module that mlx-lm split, fused or reordered is refused with the flag to use.

transformers' ``Conv1D`` (weight (in, out)) is adapted by peft with
``fan_in_fan_out=True`` and still gets lora_A (r, in) and lora_B (out, r) and the
forward ``base(x) + scale·B·A·x``; mlx-lm loads that weight transposed into an
``nn.Linear`` (out, in) computing the same ``base(x)``, so `LoRALinear` on it
computes exactly what peft computes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from yeto.island.weights import Weights
from yeto.layout import Layout
from yeto.mlx.experts import ExpertLoRA, fused_experts, refusal
from yeto.mlx.hf_paths import HFPaths, Origin, get_module, linear_paths
from yeto.targets import TargetError, expert_lora_module, peft_key, routers, select_experts

__all__ = ["DeltaLoRA", "ExpertLoRA", "LoRALinear", "LoRAWeights", "Origin", "adapter_targets",
           "attach_lora", "canonical_mlx_name",
           "get_module", "hf_module_paths", "hf_origins", "linear_paths", "lora_layers"]


def _init_factors(layer: nn.Module, in_dims: int, out_dims: int, r: int, alpha: float,
                  key: mx.array | None) -> None:
    """peft's factors on ``layer``: lora_A (r, in) kaiming-uniform(a=sqrt(5)), i.e.
    uniform(-1/sqrt(in), 1/sqrt(in)); lora_B (out, r) zeros; scaling alpha / r."""
    layer.lora_A = nn.Linear(in_dims, r, bias=False)
    layer.lora_B = nn.Linear(r, out_dims, bias=False)
    bound = 1.0 / math.sqrt(in_dims)
    layer.lora_A.weight = mx.random.uniform(-bound, bound, (r, in_dims), key=key)
    layer.lora_B.weight = mx.zeros((out_dims, r))
    layer.r = int(r)
    layer.alpha = float(alpha)
    layer.scaling = layer.alpha / layer.r


class LoRALinear(nn.Module):
    """A frozen linear plus a peft-shaped low-rank update (no dropout: the islands
    train with lora_dropout=0)."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, key: mx.array | None = None,
                 hf_path: str | None = None, out_scale=None, in_scale=None):
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
        _init_factors(self, in_dims, out_dims, r, alpha, key)
        #: the Hugging Face module path this layer adapts (its canonical names), when
        #: it differs from, or is not known from, its place in the MLX module tree
        self.hf_path = hf_path
        # multipliers mlx-lm folded into the base weight (diag(out) · W · diag(in)):
        # the torch model applies them around its linear, so to the LoRA update too
        self.out_scale = None if out_scale is None else mx.array(out_scale)
        self.in_scale = None if in_scale is None else mx.array(in_scale)
        self.freeze(keys=["out_scale", "in_scale"], recurse=False, strict=False)

    # As peft's LoRA layer: ``weight``/``bias`` are the base layer's (model code that
    # reads or clips a linear's weight directly, as gemma3n's AltUp does, sees the same
    # array on both islands, and the update is added only when the layer is called).
    def __getattr__(self, key: str):
        if key in ("weight", "bias") and "base_layer" in self:
            return getattr(self["base_layer"], key)
        return super().__getattr__(key)

    def __setattr__(self, key: str, value) -> None:
        if key in ("weight", "bias") and "base_layer" in self:
            setattr(self["base_layer"], key, value)
        else:
            super().__setattr__(key, value)

    @property
    def in_features(self) -> int:
        return int(self.lora_A.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.lora_B.weight.shape[0])

    def __call__(self, x: mx.array) -> mx.array:
        # peft: result = base_layer(x); result = result + lora_B(lora_A(dropout(x))) * scaling
        if self.out_scale is None and self.in_scale is None:
            return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling
        z = x if self.in_scale is None else x * self.in_scale
        delta = self.lora_B(self.lora_A(z)) * self.scaling
        return self.base_layer(x) + (delta if self.out_scale is None else delta * self.out_scale)


class _Ref:
    """A reference the MLX module tree does not follow (no parameter is shared)."""

    def __init__(self, module: nn.Module):
        self.module = module


class DeltaLoRA(nn.Module):
    """peft's LoRA on a Hugging Face linear that mlx-lm loads into another kind of
    layer (deepseek's ``kv_b_proj``, kept as two per-head ``MultiLinear``; see
    `yeto.mlx.hf_paths.Delta`). Each call adds peft's update ``scale·B·A`` (the HF
    weight's layout, (out, in)) to the wrapped layer's weight through a fixed index,
    so the layer computes with ``W + scale·B·A`` wherever the torch model computes
    with it. The first wrapper of a Hugging Face linear holds its lora_A (r, in) and
    lora_B (out, r); the others use those."""

    def __init__(self, base: nn.Module, key: str, index: np.ndarray,
                 owner: DeltaLoRA | None = None, *, shape: tuple[int, int] | None = None,
                 r: int = 0, alpha: float = 0.0, rng: mx.array | None = None,
                 hf_path: str | None = None):
        super().__init__()
        base.freeze()
        self.base_layer = base
        self.param = key
        self.index = mx.array(np.ascontiguousarray(index.reshape(-1), dtype=np.int32))
        self.freeze(keys=["index"], recurse=False)
        self.owner = None if owner is None else _Ref(owner)
        self.hf_path = hf_path if owner is None else None
        if owner is None:
            _init_factors(self, shape[1], shape[0], r, alpha, rng)

    def __call__(self, *args, **kwargs):
        o = self if self.owner is None else self.owner.module
        delta = (o.lora_B.weight @ o.lora_A.weight) * o.scaling
        base = self.base_layer[self.param]
        self.base_layer[self.param] = base + mx.take(delta.reshape(-1), self.index).reshape(
            base.shape).astype(base.dtype)
        try:
            return self.base_layer(*args, **kwargs)
        finally:
            self.base_layer[self.param] = base


def _quantized_in_blocks(model: nn.Module) -> list[str]:
    return [p for p, m in model.named_modules()
            if ".layers." in f".{p}" and isinstance(m, nn.QuantizedLinear)]


def hf_origins(model: nn.Module, hf_weights: Mapping[str, tuple[int, ...]] | Iterable[str],
               ) -> dict[str, Origin]:
    """{MLX linear path: `Origin`}: which Hugging Face checkpoint tensor each MLX
    linear was loaded from, and how (see `yeto.mlx.hf_paths`)."""
    return HFPaths(model, hf_weights).origins


def hf_module_paths(model: nn.Module, hf_weights: Mapping[str, tuple[int, ...]],
                    config: dict | None = None) -> dict[str, str]:
    """{MLX linear path: Hugging Face module path} for the linears that are exactly
    one HF linear (e.g. for ``LoRAWeights(model, paths=...)`` on mlx-lm's own LoRA);
    ``config``, the Hugging Face config dict, brings transformers' renames."""
    return HFPaths(model, hf_weights, config).exact()


def attach_lora(model: nn.Module, config: dict, r: int, alpha: float, targets: str = "auto",
                seed: int = 0,
                hf_weight_names: Mapping[str, tuple[int, ...]] | Iterable[str] | None = None,
                ) -> dict[str, nn.Module]:
    """Freeze the model and wrap the selected linears in `LoRALinear`.

    ``config`` is the Hugging Face config dict (config.json); ``targets`` is the
    ``--lora-targets`` value. ``hf_weight_names`` are the checkpoint's tensor
    names, best with their shapes (`yeto.mlx.hf_paths.hf_weight_names`): the MLX
    linears are then mapped to the Hugging Face module paths they were loaded
    from (`yeto.mlx.hf_paths.HFPaths`), the selection
    (`yeto.targets.select_targets`) is made on those paths, and a chosen HF linear
    that mlx-lm splits, fuses, reorders or loads into another kind of layer is
    refused. A chosen HF linear that mlx-lm loads into other layers made of its
    elements only (deepseek's ``kv_b_proj``) gets `DeltaLoRA` wrappers. Fused
    expert weights chosen by `yeto.targets.select_experts` (``all-linear``,
    entries naming ``experts``) get `yeto.mlx.experts.ExpertLoRA` on the
    ``SwitchLinear`` layers that hold them, under peft's names
    (`yeto.targets.expert_lora_module`); their router stays frozen. Without
    ``hf_weight_names``, MLX paths are taken as HF paths. Returns {Hugging Face
    module path (peft's, for expert weights): the layer that holds its lora_A and
    lora_B}."""
    quantized = _quantized_in_blocks(model)
    if quantized:
        raise ValueError(f"the MLX model has quantized linears (e.g. {quantized[0]}); load the "
                         "float32/bf16 Hugging Face checkpoint instead of an MLX-quantized one")
    model.freeze()
    paths = HFPaths(model, hf_weight_names, config)
    # the marker trace of stacked experts costs memory: only when experts may be chosen
    found, refused = ({}, {}) if targets.strip() in ("auto", "attention") else \
        fused_experts(model, paths)
    where = paths.select(targets, config)
    beside = routers([*where, *paths.deltas], found)  # the router of fused experts stays frozen
    where = {hf: mp for hf, mp in where.items() if hf not in beside}
    paths.deltas = {hf: d for hf, d in paths.deltas.items() if hf not in beside}
    params = _chosen_experts(found, refused, targets, config, paths.candidates())
    chosen = sorted([*where, *paths.deltas, *params])
    keys = dict(zip(chosen, mx.random.split(mx.random.key(seed), len(chosen))))
    layers: dict[str, nn.Module] = {}
    placed: list[tuple[str, nn.Module]] = []
    for hf, mp in where.items():
        scale = paths.origin_of(mp).scale
        layers[hf] = LoRALinear(get_module(model, mp), r, alpha, key=keys[hf], hf_path=hf,
                                out_scale=scale[0], in_scale=scale[1])
        placed.append((mp, layers[hf]))
    for hf, delta in paths.deltas.items():
        for module, key, index in delta.holders:
            wrapper = DeltaLoRA(get_module(model, module), key, index, layers.get(hf),
                                shape=delta.shape, r=r, alpha=alpha, rng=keys[hf], hf_path=hf)
            layers.setdefault(hf, wrapper)
            placed.append((module, wrapper))
    placed += _expert_wrappers(model, {p: found[p] for p in params}, r, alpha, keys, layers)
    model.update_modules(tree_unflatten(placed))
    layers = dict(sorted(layers.items()))
    mx.eval([(x.lora_A.weight, x.lora_B.weight) for x in layers.values()])
    return layers


def _chosen_experts(found: dict, refused: dict[str, str], targets: str, config: dict,
                    candidates: list[str]) -> list[str]:
    """The fused expert weights `yeto.targets.select_experts` picks; refused when
    the model has ``SwitchLinear`` layers `yeto.mlx.experts` cannot map."""
    params = select_experts([*found, *(f"{m}.weight" for m in refused)], targets, config,
                            candidates)
    if params and refused:
        raise TargetError(refusal(next(iter(refused.values()))))
    return params


def _expert_wrappers(model: nn.Module, fused: dict, r: int, alpha: float, keys: dict,
                     layers: dict[str, nn.Module]) -> list[tuple[str, nn.Module]]:
    """`ExpertLoRA` on every ``SwitchLinear`` part of the chosen fused weights (the
    first part of each holds the factors, under peft's name, into ``layers``)."""
    placed = []
    for param, spec in fused.items():
        name = expert_lora_module(param, fused)
        for part in spec.parts:
            wrapper = ExpertLoRA(get_module(model, part.module), part.rows, layers.get(name),
                                 shape=spec.shape, r=r, alpha=alpha, key=keys[param],
                                 hf_path=name, param=param)
            layers.setdefault(name, wrapper)
            placed.append((part.module, wrapper))
    return placed


def adapter_targets(layers: Mapping[str, nn.Module]) -> tuple[list[str], list[str]]:
    """(target_modules, target_parameters) of peft's config for `attach_lora`'s
    layers: the adapted linears' module paths, the fused expert weights' paths."""
    params = sorted(m.param for m in layers.values() if isinstance(m, ExpertLoRA))
    return sorted(p for p, m in layers.items() if not isinstance(m, ExpertLoRA)), params


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """{module path: layer that holds LoRA factors} of a model with LoRA attached
    (`LoRALinear`, and the first `DeltaLoRA` of each Hugging Face linear)."""
    return {p: m for p, m in model.named_modules()
            if isinstance(m, (LoRALinear, DeltaLoRA, ExpertLoRA)) and "lora_A" in m}


_PEFT_PREFIX = "base_model.model."


def canonical_mlx_name(name: str, paths: Mapping[str, str] | None = None) -> tuple[str, bool]:
    """(canonical name, transposed) of a trainable MLX parameter path.

    yeto's `LoRALinear` holds peft's shapes: ``<m>.lora_A.weight`` (r, in) is
    ``base_model.model.<m>.lora_A.weight`` as is. mlx-lm's LoRA layer holds them
    transposed: ``<m>.lora_a`` (in, r) is that name's transpose, ``<m>.lora_b``
    (r, out) is ``...lora_B.weight``'s. ``paths`` maps MLX module paths to Hugging
    Face ones where they differ (`hf_module_paths`). Any other parameter keeps its
    (Hugging Face) name, as in full fine-tuning."""
    paths = paths or {}
    for suffix in (".lora_A.weight", ".lora_B.weight"):
        if name.endswith(suffix):
            module = name[:-len(suffix)]
            return peft_key(paths.get(module, module), suffix[1:-len(".weight")]), False
    for suffix, which in ((".lora_a", "lora_A"), (".lora_b", "lora_B")):
        if name.endswith(suffix):
            module = name[:-len(suffix)]
            return peft_key(paths.get(module, module), which), True
    return name, False


def transpose_3d(name: str, value: mx.array) -> bool:
    """An mlx-lm LoRA factor (``lora_a``/``lora_b``) with an experts axis."""
    return name.endswith((".lora_a", ".lora_b")) and value.ndim == 3


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


class LoRAWeights(Weights):
    """An MLX model's trainable weights under canonical peft names, as one flat
    float32 vector in `yeto.layout` canonical order (the island's view of the model,
    `yeto.island.Weights`; no range access).

    ``source`` is either ``{module path: LoRALinear}`` (what `attach_lora` returns;
    the MLX island) or a model whose trainable parameters are the weights: yeto's
    `LoRALinear` layers, mlx-lm's (``linear_to_lora_layers``; their transposed
    ``lora_a``/``lora_b`` are seen as peft's ``lora_A``/``lora_B``), and any other
    unfrozen parameter under its own name (see `canonical_mlx_name`). Names use the
    Hugging Face module paths: yeto's layers know theirs (``hf_path``); for
    mlx-lm's layers on a model whose module tree differs from the Hugging Face
    one, pass ``paths`` ({MLX module path: HF module path}, `hf_module_paths`).
    Arrays keep their dtype when set."""

    def __init__(self, source: dict[str, LoRALinear] | nn.Module,
                 paths: Mapping[str, str] | None = None):
        self._slots: dict[str, _Slot] = {}
        if isinstance(source, nn.Module):
            known = {p: m.hf_path for p, m in lora_layers(source).items() if m.hf_path}
            known.update(paths or {})
            for name, value in tree_flatten(source.trainable_parameters()):
                if transpose_3d(name, value):
                    raise ValueError(
                        f"{name} {list(value.shape)} is a factor of mlx-lm's LoRASwitchLinear "
                        "(LoRA on SwitchLinear experts), which has no peft name here; attach "
                        "LoRA with yeto.mlx.lora.attach_lora(model, config, r, alpha, "
                        "'all-linear', hf_weight_names=...) instead, or leave the experts out "
                        "of mlx-lm's lora keys")
                canonical, transpose = canonical_mlx_name(name, known)
                self._slots[canonical] = _Slot(source, name, transpose)
        else:
            for path, layer in source.items():
                path = getattr(layer, "hf_path", None) or path
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
