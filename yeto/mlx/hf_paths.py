"""mlx-lm's module paths, as the Hugging Face module paths they were loaded from.

Canonical LoRA names are peft's, i.e. Hugging Face module paths, but mlx-lm's
module tree is not always the Hugging Face one: gpt2's ``transformer.h.N`` is
``model.h.N``, gpt_neox's ``gpt_neox.layers.N`` is ``model.h.N``, gpt2's
``Conv1D`` weights (in, out) are transposed into ``nn.Linear`` (out, in), and
some weights are split (deepseek's ``kv_b_proj`` into per-head ``MultiLinear``),
fused (experts stacked into ``SwitchLinear``) or reordered when mlx-lm loads them.

`HFPaths` finds out which by replaying the model's own ``sanitize`` (the function
that turns a Hugging Face checkpoint into mlx-lm's parameters) on **marker
arrays**: every element of checkpoint tensor ``i`` holds its own global index
(plus one; int64, lazy; nothing is computed for tensors never looked at). Each sanitized
array then says exactly which checkpoint elements it holds, in which order, so
every MLX linear gets an `Origin`: the checkpoint tensor it is (``same``), or its
transpose (``transposed``), or a slice of one (``part``), or a mix of several
(``fused``), or a reordering (``reordered``). Only ``same`` and ``transposed``
are one Hugging Face linear that LoRA can wrap with the same function as peft;
a chosen module with any other origin, or one that mlx-lm loads into a layer that
is not a linear, is refused with the flag to use.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from safetensors import safe_open

from yeto.mlx.hf_renames import renamer
from yeto.targets import FLAG, TargetError, block_relative, choose, is_expert, select_targets

log = logging.getLogger("yeto.mlx.hf_paths")

#: layers that hold 2-D weights but are not linears (never LoRA targets)
_NOT_LINEAR = ("Embedding", "Norm")


def hf_weight_names(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of the Hugging Face checkpoint (headers only): what
    `yeto.mlx.lora.attach_lora` maps mlx-lm's module paths to Hugging Face's with."""
    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(Path(model_dir).glob("model*.safetensors")):
        with safe_open(str(f), framework="numpy") as st:
            shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    return shapes


def get_module(model: nn.Module, path: str) -> nn.Module:
    m = model
    for part in path.split("."):
        m = m[int(part)] if isinstance(m, list) else m[part]
    return m


def linear_paths(model: nn.Module) -> list[str]:
    """MLX module paths of the model's plain linears."""
    return [p for p, m in model.named_modules() if p and isinstance(m, nn.Linear)]


@dataclass(frozen=True)
class Origin:
    """Where an MLX linear's weight comes from in the Hugging Face checkpoint
    (``kind``: same, transposed, scaled, part, fused, reordered, computed or
    unknown; ``tensors``: the checkpoint tensor names it holds elements of)."""

    kind: str
    tensors: tuple[str, ...] = ()
    #: ``scaled``: the MLX weight is diag(out) · W · diag(in) (mlx-lm folded
    #: multipliers into it); (out, in), either None where it is all ones
    scale: tuple = field(default=(None, None), compare=False)

    @property
    def exact(self) -> bool:
        return self.kind in ("same", "transposed", "scaled")


class _Trace:
    """The model's ``sanitize`` run on marker arrays (see the module docstring)."""

    def __init__(self, model: nn.Module, hf_shapes: Mapping[str, tuple[int, ...]]):
        self.names = sorted(hf_shapes)
        self.shapes = {n: tuple(hf_shapes[n]) for n in self.names}
        sizes = [math.prod(self.shapes[n]) for n in self.names]
        self.starts = np.cumsum([0, *sizes])
        self.index = {n: i for i, n in enumerate(self.names)}
        markers = {n: self.marker(n) for n in self.names}
        # no reference to the markers is kept: an array looked at (and so computed)
        # is freed once `take` hands it out and the caller drops it
        self.out: dict[str, mx.array] | None = markers
        if hasattr(model, "sanitize"):
            try:
                self.out = model.sanitize(markers)
            except Exception as e:  # noqa: BLE001 - falls back to the names as they are
                log.debug("sanitize on markers failed (%s: %s); MLX paths are taken as "
                          "Hugging Face paths", type(e).__name__, e)
                self.out = None

    def marker(self, name: str) -> mx.array:
        """Checkpoint tensor ``name`` as markers (lazy): element j holds start + j + 1
        (never 0, so a multiplier folded into it shows)."""
        i = self.index[name]
        return mx.arange(int(self.starts[i]) + 1, int(self.starts[i + 1]) + 1,
                         dtype=mx.int64).reshape(self.shapes[name])

    def take(self, key: str) -> mx.array | None:
        """The sanitized array of MLX parameter ``key``, removed from the trace."""
        return self.out.pop(key, None) if self.out is not None else None

    def sources(self, arr: mx.array) -> list[str] | None:
        """The checkpoint tensors an array holds elements of (from its edges), or
        None when it is not made of markers (computed by sanitize, not moved)."""
        if arr.dtype != mx.int64 or arr.size == 0:
            return None
        a = arr.reshape(arr.shape[0], -1) if arr.ndim > 1 else arr.reshape(1, -1)
        probe = np.concatenate([np.asarray(x) for x in (a[:, 0], a[0], a[-1], a[:, -1])]) - 1
        if probe.min() < 0 or probe.max() >= self.starts[-1]:
            return None
        ids = sorted(set(np.searchsorted(self.starts, probe, side="right").tolist()))
        return [self.names[i - 1] for i in ids]

    def origin(self, arr: mx.array) -> Origin:
        tensors = self.sources(arr) if arr.ndim == 2 else None
        if not tensors:
            return Origin("unknown")
        if len(tensors) > 1:
            return Origin("fused", tuple(tensors))
        src = self.marker(tensors[0])
        if arr.size < src.size:
            return Origin("part", tuple(tensors))
        if arr.shape == src.shape and mx.array_equal(arr, src).item():
            return Origin("same", tuple(tensors))
        if src.ndim == 2 and arr.shape == src.shape[::-1] and mx.array_equal(arr, src.T).item():
            return Origin("transposed", tuple(tensors))
        return Origin("reordered", tuple(tensors))

    def scaled(self, arr: mx.array, name: str) -> tuple | None:
        """(out, in) with arr == diag(out) · W · diag(in), W = checkpoint tensor
        ``name`` (a multiplier sanitize folded in: markers times floats), else None."""
        src = np.asarray(self.marker(name)).astype(np.float64)
        if arr.ndim != 2 or tuple(arr.shape) != src.shape:
            return None
        a = np.asarray(arr.astype(mx.float32)).astype(np.float64)
        out = a[:, 0] / src[:, 0]
        inn = a[0] / (src[0] * out[0])
        if not out.all() or not np.allclose(a, out[:, None] * src * inn[None], rtol=1e-5, atol=0):
            return None
        ones = np.ones(1)
        return (None if np.allclose(out, ones, rtol=1e-6) else out.astype(np.float32),
                None if np.allclose(inn, ones, rtol=1e-6) else inn.astype(np.float32))

    def holders(self, hf_name: str) -> list[str]:
        """MLX parameter names that hold elements of checkpoint tensor ``hf_name``
        (looked for among the parameters of the same decoder block first)."""
        out = self.out or {}
        block = re.search(r"\.(\d+)\.", hf_name)
        near = [k for k in out if block and f".{block.group(1)}." in f".{k}."]
        for keys in (near, list(out)):
            found = [k for k in keys if hf_name in (self.sources(out[k]) or ())]
            if found:
                return found
        return []

    def index_into(self, key: str, hf_name: str) -> np.ndarray | None:
        """For MLX parameter ``key`` made only of elements of checkpoint tensor
        ``hf_name``: each element's flat position in ``hf_name`` (``key``'s shape)."""
        arr = (self.out or {}).get(key)
        if arr is None or arr.dtype != mx.int64:
            return None
        i = self.index[hf_name]
        idx = np.asarray(arr) - 1 - int(self.starts[i])
        if idx.min() < 0 or idx.max() >= self.starts[i + 1] - self.starts[i]:
            return None
        return idx


@dataclass
class Delta:
    """LoRA on a Hugging Face linear that mlx-lm loads into other layers (deepseek's
    ``kv_b_proj`` as two per-head ``MultiLinear``): its update ``scale·B·A`` (HF
    layout, (out, in)) is added to each holder's weight through ``index`` (the flat
    position in the HF weight of every element of the holder's weight)."""

    shape: tuple[int, int]
    holders: list[tuple[str, str, np.ndarray]]  # (module path, parameter name, index)


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


def _names_for(good: Iterable[str], bad: Iterable[str]) -> str:
    """A --lora-targets value naming the good modules and none of the bad ones: leaf
    names, or ``parent.leaf`` where a bad module has the same leaf."""
    bad_leaves = {b.rsplit(".", 1)[-1] for b in bad}
    names = {".".join(g.split(".")[-2:]) if g.rsplit(".", 1)[-1] in bad_leaves
             else g.rsplit(".", 1)[-1] for g in good}
    return ",".join(sorted(names))


class HFPaths:
    """An mlx-lm model's linears under Hugging Face module paths.

    ``hf_weights`` maps the checkpoint's tensor names to their shapes
    (`hf_weight_names`): the model's ``sanitize`` is replayed on markers. With
    names only, or when ``sanitize`` cannot run on markers, an MLX linear is the
    Hugging Face module of the same path (and shape); with None, MLX paths are
    taken as Hugging Face paths unchecked. ``config`` (the Hugging Face config
    dict) brings transformers' load-time renames of checkpoint names
    (`yeto.mlx.hf_renames`), so module paths are the ones peft names."""

    def __init__(self, model: nn.Module,
                 hf_weights: Mapping[str, tuple[int, ...]] | Iterable[str] | None = None,
                 config: dict | None = None):
        self.model = model
        self.shapes = hf_weights if isinstance(hf_weights, Mapping) else None
        self.trace = _Trace(model, hf_weights) if self.shapes is not None else None
        rename = renamer(config or {})
        paths = linear_paths(model)
        if hf_weights is None:
            self.origins = {p: Origin("same", (f"{p}.weight",)) for p in paths}
        elif self.trace is None or self.trace.out is None:
            names = self.shapes if self.shapes is not None else set(hf_weights)
            self.origins = {p: _origin_by_name(model, p, names) for p in paths}
        else:
            self.origins = {p: self._traced(f"{p}.weight") for p in paths}
            mx.clear_cache()
        names = self.shapes or {t: () for o in self.origins.values() for t in o.tensors}
        #: checkpoint tensor name -> the Hugging Face module path it loads into
        self.module_of = {n: rename(n).removesuffix(".weight") for n in names}
        self.by_hf: dict[str, list[tuple[str, Origin]]] = {}
        for p, o in self.origins.items():
            for hf in self.modules(o):
                self.by_hf.setdefault(hf, []).append((p, o))

    def _traced(self, key: str) -> Origin:
        arr = self.trace.take(key)
        origin = Origin("unknown") if arr is None else self.trace.origin(arr)
        if origin.kind == "unknown" and arr is not None and key in self.shapes:
            scale = self.trace.scaled(arr, key)  # sanitize did arithmetic on it
            return Origin("scaled", (key,), scale) if scale else Origin("computed", (key,))
        return origin

    def modules(self, origin: Origin) -> list[str]:
        return [self.module_of[t] for t in origin.tensors]

    def origin_of(self, mlx_path: str) -> Origin:
        return self.origins[mlx_path]

    def exact(self) -> dict[str, str]:
        """{MLX linear path: HF module path} of the linears that are exactly one HF linear."""
        return {p: self.modules(o)[0] for p, o in self.origins.items() if o.exact}

    def candidates(self) -> list[str]:
        """HF module paths the selection runs on: those of the MLX linears, and the
        2-D weights in decoder blocks that no MLX linear holds (Hugging Face
        linears mlx-lm loads otherwise; refused if chosen, see `select`)."""
        out = set(self.by_hf)
        if self.trace is not None and self.trace.out is not None:
            out.update(self.module_of[n] for n, s in self.shapes.items()
                       if n.endswith(".weight") and len(s) == 2
                       and not is_expert(self.module_of[n] + ".")
                       and block_relative(self.module_of[n]) is not None)
        return sorted(out)

    def _why_not(self, hf: str, entries: list[tuple[str, Origin]]) -> str:
        """Why the chosen HF module, held by MLX linears ``entries``, cannot get LoRA."""
        mlx = ", ".join(p for p, _ in entries)
        if len(entries) > 1 or entries[0][1].kind == "part":
            return (f"mlx-lm splits the Hugging Face linear {hf} into {len(entries)} linear(s) "
                    f"({mlx}) when it loads the model")
        if entries[0][1].kind == "fused":
            return (f"mlx-lm fuses {', '.join(self.modules(entries[0][1]))} into one linear "
                    f"({mlx}) when it loads the model")
        if entries[0][1].kind == "computed":
            return (f"mlx-lm computes the weight of {hf} ({mlx}) from the checkpoint when it "
                    "loads the model (e.g. folds a multiplier into it)")
        return f"mlx-lm stores the weight of {hf} ({mlx}) in another order"

    def _loose(self, hf: str) -> tuple[Delta | None, str | None]:
        """A chosen HF module no MLX linear holds: (its `Delta`, None) when mlx-lm
        loads it into other layers whose weights are made of its elements only,
        (None, why) when it cannot get LoRA, (None, None) when it is no linear on
        the MLX island either (an embedding, a norm) and is left out."""
        tensor = next((n for n, m in self.module_of.items() if m == hf and n.endswith(".weight")),
                      f"{hf}.weight")
        holders = self.trace.holders(tensor) if self.trace is not None else []
        if not holders:
            return None, f"mlx-lm does not load the Hugging Face weight {tensor}"
        kinds = {type(get_module(self.model, h.rsplit(".", 1)[0])).__name__ for h in holders}
        if all(any(x in k for x in _NOT_LINEAR) for k in kinds):
            return None, None
        index = [self.trace.index_into(h, tensor) for h in holders]
        if len(self.shapes[tensor]) == 2 and all(i is not None for i in index):
            return Delta(tuple(self.shapes[tensor]),
                         [(*h.rsplit(".", 1), i) for h, i in zip(holders, index)]), None
        return None, (f"mlx-lm loads the Hugging Face linear {hf} into "
                      f"{', '.join(sorted(kinds))} ({', '.join(holders)}) together with other "
                      "weights, not a layer LoRA can wrap")

    def _stray_check(self, targets: str, config: dict) -> None:
        """MLX linears with no Hugging Face counterpart must not be ones the rule picks."""
        unknown = [p for p, o in self.origins.items() if not o.tensors]
        try:
            stray = choose(unknown, targets, config)
        except TargetError:
            stray = []
        if stray:
            raise TargetError(
                f"mlx-lm's linear {stray[0]} ({len(stray)} such) has no Hugging Face counterpart "
                "in the checkpoint, so its canonical peft name cannot be derived; check with "
                "`yeto check-parity --model ...`, or pass the modules to adapt, e.g. "
                f"{FLAG} q_proj,v_proj")

    def select(self, targets: str, config: dict) -> dict[str, str]:
        """{HF module path: MLX linear path} of the linears to adapt
        (`yeto.targets.select_targets` on the HF paths); the chosen HF linears that
        mlx-lm loads into other layers are in ``self.deltas`` ({HF path: `Delta`}).
        Raises `TargetError` for a chosen module that cannot get the same LoRA."""
        self._stray_check(targets, config)
        chosen = select_targets(self.candidates(), targets, config)
        where, bad = {}, {}
        self.deltas: dict[str, Delta] = {}
        for hf in chosen:
            entries = self.by_hf.get(hf, [])
            if len(entries) == 1 and entries[0][1].exact:
                where[hf] = entries[0][0]
                continue
            delta, reason = self._loose(hf) if not entries else (None, self._why_not(hf, entries))
            if delta is not None:
                self.deltas[hf] = delta
            elif reason is not None:
                bad[hf] = reason
        if bad:
            good = [*where, *self.deltas]
            hint = f"{FLAG} {_names_for(good, bad)}" if good else f"{FLAG} with other modules"
            first = next(iter(bad))
            raise TargetError(f"{bad[first]}, so a LoRA on it cannot be the same on the torch and "
                              f"MLX islands ({len(bad)} such module(s)). Leave it out, e.g. {hint}")
        return where
