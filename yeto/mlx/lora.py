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
Hugging Face config and the Hugging Face module paths, the same call the torch
island makes. mlx-lm's module tree is not always the Hugging Face one (gpt2's
``transformer.h.N`` is ``model.h.N``, gpt_neox's ``gpt_neox.layers.N`` is
``model.h.N``, gpt2's ``Conv1D`` weights are transposed into ``nn.Linear``, some
weights are split or fused): `hf_origins` finds, for every MLX linear, the
checkpoint tensor it was loaded from by replaying the model's own ``sanitize`` on
marker arrays, and canonical names always use the Hugging Face path. A chosen
module that mlx-lm split, fused or reordered is refused with the flag to use.

transformers' ``Conv1D`` (weight (in, out)) is adapted by peft with
``fan_in_fan_out=True`` and still gets lora_A (r, in) and lora_B (out, r) and the
forward ``base(x) + scale·B·A·x``; mlx-lm loads that weight transposed into an
``nn.Linear`` (out, in) computing the same ``base(x)``, so `LoRALinear` on it
computes exactly what peft computes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from yeto.layout import Layout
from yeto.targets import FLAG, TargetError, choose, peft_key, select_targets

log = logging.getLogger("yeto.mlx.lora")


class LoRALinear(nn.Module):
    """A frozen linear plus a peft-shaped low-rank update (no dropout: the islands
    train with lora_dropout=0)."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, key: mx.array | None = None,
                 hf_path: str | None = None):
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
        #: the Hugging Face module path this layer adapts (its canonical names), when
        #: it differs from, or is not known from, its place in the MLX module tree
        self.hf_path = hf_path

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
    """MLX module paths of the model's plain linears."""
    return [p for p, m in model.named_modules() if p and isinstance(m, nn.Linear)]


def _quantized_in_blocks(model: nn.Module) -> list[str]:
    return [p for p, m in model.named_modules()
            if ".layers." in f".{p}" and isinstance(m, nn.QuantizedLinear)]


# ---- MLX module paths -> Hugging Face module paths ----------------------------
@dataclass(frozen=True)
class Origin:
    """Where an MLX linear's weight comes from in the Hugging Face checkpoint.

    ``kind``: ``same`` (the HF tensor as is), ``transposed`` (an HF tensor stored
    (in, out), e.g. transformers' ``Conv1D``), ``part`` (a slice of one HF tensor:
    mlx-lm splits it), ``fused`` (built from several HF tensors), ``reordered``
    (one HF tensor's values in another order), ``unknown`` (not found).
    ``tensors``: the HF tensor names it was built from."""

    kind: str
    tensors: tuple[str, ...] = ()

    @property
    def exact(self) -> bool:
        return self.kind in ("same", "transposed")

    @property
    def modules(self) -> tuple[str, ...]:
        """The HF module paths of its tensors (``...q_proj.weight`` -> ``...q_proj``)."""
        return tuple(t[:-len(".weight")] if t.endswith(".weight") else t for t in self.tensors)


class _Trace:
    """mlx-lm's ``sanitize`` run on marker arrays instead of the checkpoint: every
    element of HF tensor ``i`` holds its own global index (int64, lazy), so each
    sanitized array tells exactly which HF tensor elements it holds, in which
    order. Nothing is computed for tensors that are never looked at."""

    def __init__(self, model: nn.Module, hf_shapes: Mapping[str, tuple[int, ...]]):
        self.names = sorted(hf_shapes)
        sizes = [math.prod(hf_shapes[n]) for n in self.names]
        self.starts = np.cumsum([0, *sizes])
        self.markers = {n: mx.arange(int(self.starts[i]), int(self.starts[i + 1]),
                                     dtype=mx.int64).reshape(tuple(hf_shapes[n]))
                        for i, n in enumerate(self.names)}
        self.out: dict[str, mx.array] | None = dict(self.markers)
        if hasattr(model, "sanitize"):
            try:
                self.out = model.sanitize(dict(self.markers))
            except Exception as e:  # noqa: BLE001 - falls back to the names as they are
                log.debug("sanitize on markers failed (%s: %s); MLX paths are taken as "
                          "Hugging Face paths", type(e).__name__, e)
                self.out = None

    def origin(self, arr: mx.array) -> Origin:
        if arr.dtype != mx.int64 or arr.ndim != 2 or arr.size == 0:
            return Origin("unknown")
        probe = np.concatenate([np.asarray(a) for a in (arr[:, 0], arr[0], arr[-1], arr[:, -1])])
        if probe.min() < 0 or probe.max() >= self.starts[-1]:
            return Origin("unknown")
        ids = sorted(set(np.searchsorted(self.starts, probe, side="right").tolist()))
        tensors = tuple(self.names[i - 1] for i in ids)
        if len(tensors) > 1:
            return Origin("fused", tensors)
        src = self.markers[tensors[0]]
        if arr.size < src.size:
            return Origin("part", tensors)
        if arr.shape == src.shape and mx.array_equal(arr, src).item():
            return Origin("same", tensors)
        if src.ndim == 2 and arr.shape == src.shape[::-1] and mx.array_equal(arr, src.T).item():
            return Origin("transposed", tensors)
        return Origin("reordered", tensors)


def _origin_by_name(model: nn.Module, path: str, hf_shapes) -> Origin:
    """No trace: the MLX path must be the HF path, with the same or the
    transposed shape (or any shape when only names are known)."""
    name = f"{path}.weight"
    if name not in hf_shapes:
        return Origin("unknown")
    if not isinstance(hf_shapes, Mapping):
        return Origin("same", (name,))
    shape, hf = tuple(get_module(model, path).weight.shape), tuple(hf_shapes[name])
    kind = "same" if shape == hf else "transposed" if shape == hf[::-1] else "unknown"
    return Origin(kind, (name,))


def hf_origins(model: nn.Module, hf_weights: Mapping[str, tuple[int, ...]] | Iterable[str],
               ) -> dict[str, Origin]:
    """{MLX linear path: `Origin`} for an mlx-lm model loaded from a Hugging Face
    checkpoint. ``hf_weights`` maps the checkpoint's tensor names to their shapes
    (`yeto.mlx.learner.hf_weight_names`); the model's own ``sanitize`` is replayed
    on marker arrays (see `_Trace`), which covers renamed prefixes
    (``transformer.h.N`` -> ``model.h.N``), transposed weights (gpt2's ``Conv1D``),
    and splits and fusions (reported as such). With names only, or when
    ``sanitize`` cannot run on markers, MLX paths are matched to HF paths by name."""
    paths = linear_paths(model)
    trace = _Trace(model, hf_weights) if isinstance(hf_weights, Mapping) else None
    if trace is None or trace.out is None:
        names = hf_weights if isinstance(hf_weights, Mapping) else set(hf_weights)
        return {p: _origin_by_name(model, p, names) for p in paths}
    out = {}
    for p in paths:
        arr = trace.out.get(f"{p}.weight")
        out[p] = Origin("unknown") if arr is None else trace.origin(arr)
    return out


def hf_module_paths(model: nn.Module, hf_weights: Mapping[str, tuple[int, ...]]
                    ) -> dict[str, str]:
    """{MLX linear path: Hugging Face module path} for the linears that are exactly
    one HF linear (e.g. for ``LoRAWeights(model, paths=...)`` on mlx-lm's own LoRA)."""
    return {p: o.modules[0] for p, o in hf_origins(model, hf_weights).items() if o.exact}


def _why_not(hf: str, entries: list[tuple[str, Origin]]) -> str:
    mlx = ", ".join(p for p, _ in entries)
    kind = entries[0][1].kind
    if len(entries) > 1 or kind == "part":
        return (f"mlx-lm splits the Hugging Face linear {hf} into {len(entries)} linear(s) "
                f"({mlx}) when it loads the model")
    if kind == "fused":
        return (f"mlx-lm fuses {', '.join(entries[0][1].modules)} into one linear ({mlx}) "
                "when it loads the model")
    return f"mlx-lm stores the weight of {hf} ({mlx}) in another order"


def _resolve(origins: dict[str, Origin], chosen: list[str]) -> dict[str, str]:
    """{HF path: MLX path} of the chosen HF linears; refuses any without exactly
    one MLX linear that holds exactly its weight."""
    by_hf: dict[str, list[tuple[str, Origin]]] = {}
    for p, o in origins.items():
        for hf in o.modules:
            by_hf.setdefault(hf, []).append((p, o))
    bad = {hf: _why_not(hf, by_hf[hf]) for hf in chosen
           if len(by_hf[hf]) != 1 or not by_hf[hf][0][1].exact}
    if bad:
        leaves = sorted({h.rsplit(".", 1)[-1] for h in chosen})
        left = [x for x in leaves if x not in {h.rsplit(".", 1)[-1] for h in bad}]
        hint = f"{FLAG} {','.join(left)}" if left else f"{FLAG} with other modules"
        first = next(iter(bad))
        raise TargetError(f"{bad[first]}, so a LoRA on it cannot be the same on the torch and "
                          f"MLX islands ({len(bad)} such module(s)). Leave it out, e.g. {hint}")
    return {hf: by_hf[hf][0][0] for hf in chosen}


def _stray_check(origins: dict[str, Origin], targets: str, config: dict) -> None:
    """MLX linears with no Hugging Face counterpart must not be ones the rule picks."""
    unknown = [p for p, o in origins.items() if not o.modules]
    try:
        stray = choose(unknown, targets, config)
    except TargetError:
        stray = []
    if stray:
        raise TargetError(
            f"mlx-lm's linear {stray[0]} ({len(stray)} such) has no Hugging Face counterpart in "
            "the checkpoint, so its canonical peft name cannot be derived; check with "
            "scripts/check_name_parity.py --model ..., or pass the modules to adapt, e.g. "
            f"{FLAG} q_proj,v_proj")


def attach_lora(model: nn.Module, config: dict, r: int, alpha: float, targets: str = "auto",
                seed: int = 0,
                hf_weight_names: Mapping[str, tuple[int, ...]] | Iterable[str] | None = None,
                ) -> dict[str, LoRALinear]:
    """Freeze the model and wrap the selected linears in `LoRALinear`.

    ``config`` is the Hugging Face config dict (config.json); ``targets`` is the
    ``--lora-targets`` value. ``hf_weight_names`` are the checkpoint's tensor
    names, best with their shapes (`yeto.mlx.learner.hf_weight_names`): the MLX
    linears are then mapped to the Hugging Face module paths they were loaded
    from (`hf_origins`), the selection (`yeto.targets.select_targets`) is made on
    those paths, and a chosen HF linear that mlx-lm split, fused or reordered is
    refused. Without it, MLX paths are taken as HF paths. Returns
    {Hugging Face module path: layer}."""
    quantized = _quantized_in_blocks(model)
    if quantized:
        raise ValueError(f"the MLX model has quantized linears (e.g. {quantized[0]}); load the "
                         "float32/bf16 Hugging Face checkpoint instead of an MLX-quantized one")
    model.freeze()
    if hf_weight_names is None:
        origins = {p: Origin("same", (f"{p}.weight",)) for p in linear_paths(model)}
    else:
        origins = hf_origins(model, hf_weight_names)
    _stray_check(origins, targets, config)
    chosen = select_targets([m for o in origins.values() for m in o.modules], targets, config)
    where = _resolve(origins, chosen)
    keys = mx.random.split(mx.random.key(seed), len(chosen))
    layers = {hf: LoRALinear(get_module(model, where[hf]), r, alpha, key=keys[i], hf_path=hf)
              for i, hf in enumerate(chosen)}
    model.update_modules(tree_unflatten([(where[hf], layer) for hf, layer in layers.items()]))
    mx.eval([(x.lora_A.weight, x.lora_B.weight) for x in layers.values()])
    return layers


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """{module path: LoRALinear} of a model with LoRA attached."""
    return {p: m for p, m in model.named_modules() if isinstance(m, LoRALinear)}


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
    unfrozen parameter under its own name (see `canonical_mlx_name`). Names use the
    Hugging Face module paths: yeto's layers know theirs (``hf_path``); for
    mlx-lm's layers on a model whose module tree differs from the Hugging Face
    one, pass ``paths`` ({MLX module path: HF module path}, `hf_module_paths`).
    Arrays keep their dtype when set."""

    def __init__(self, source: dict[str, LoRALinear] | nn.Module,
                 paths: Mapping[str, str] | None = None):
        self._slots: dict[str, _Slot] = {}
        if isinstance(source, nn.Module):
            known = {p: m.hf_path for p, m in source.named_modules()
                     if isinstance(m, LoRALinear) and m.hf_path}
            known.update(paths or {})
            for name, _ in tree_flatten(source.trainable_parameters()):
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
