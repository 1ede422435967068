"""peft's LoRA on fused mixture-of-experts weights, in MLX.

transformers 5 holds a MoE block's experts as 3-D weights of one module
(``model.layers.N.mlp.experts.gate_up_proj`` (E, 2I, H): per expert the gate rows,
then the up rows; ``down_proj`` (E, H, I)), built from the checkpoint's per-expert
tensors (``experts.<e>.gate_proj.weight`` / ``w1``, ``up_proj`` / ``w3``,
``down_proj`` / ``w2``). peft adapts such a weight with ``target_parameters``
(``ParamWrapper``):

    lora_A: (r·E, in),  A_e = lora_A.reshape(E, r, in)[e]
    lora_B: (out, r·E), B_e = lora_B.reshape(out, r, E)[:, :, e]   (expert-minor!)
    W_e + (alpha / r) · B_e · A_e                                    for every expert e

with peft's init (lora_A kaiming-uniform, bound 1/sqrt(in); lora_B zeros) and names
``base_model.model.<module>.lora_A.weight`` where ``<module>`` is
`yeto.targets.expert_lora_module` (``mlp.experts.base_layer`` for gate_up_proj
beside down_proj: peft nests one wrapper per weight).

mlx-lm stacks the same per-expert tensors into ``SwitchLinear`` layers (weight
(E, out, in); ``switch_mlp.gate_proj``, ``up_proj``, ``down_proj``). `fused_experts`
finds, by the marker trace of `yeto.mlx.hf_paths` (the model's own ``sanitize`` run
on arrays whose elements are their checkpoint positions), which checkpoint tensors
every ``SwitchLinear`` holds, and so which rows of which transformers weight: a
``SwitchLinear`` is a *part* (gate_proj: rows 0..I of gate_up_proj). `ExpertLoRA`
wraps each part and adds ``scale · x·A_eᵀ·B_e[rows]ᵀ`` for each token's experts
(``gather_mm``, as mlx-lm's own ``LoRASwitchLinear``): the same function peft's
merged weight computes, and the same factors, names and shapes. A checkpoint that
already stores fused expert weights (gpt-oss, llama4: transposed or interleaved
layouts) is refused with the flag to use.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from yeto.targets import FLAG, block_relative

#: checkpoint leaf names of per-expert tensors -> (transformers' fused weight, part)
_ROLES = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
          "down_proj": "down", "w2": "down"}
_PER_EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<e>\d+)\.(?P<leaf>\w+)$")


@dataclass
class Part:
    """A ``SwitchLinear`` (MLX module path) holding rows of a fused weight: row ``o``
    of expert ``e`` is the fused weight's row ``rows[e, o]``."""

    module: str
    rows: np.ndarray


@dataclass
class Fused:
    """A transformers fused expert weight (``param``: its parameter path) as mlx-lm
    holds it: shape (E, out, in) and the ``SwitchLinear`` parts."""

    param: str
    shape: tuple[int, int, int]
    parts: list[Part] = field(default_factory=list)


def _switch_layers(model: nn.Module) -> list[str]:
    return [p for p, m in model.named_modules()
            if type(m).__name__ in ("SwitchLinear", "QuantizedSwitchLinear")
            and block_relative(p) is not None]


def _decode(trace, arr: mx.array) -> tuple[np.ndarray, np.ndarray]:
    """(checkpoint tensor index, flat position in it) of every element of ``arr``."""
    flat = np.asarray(arr).astype(np.int64) - 1
    ids = np.searchsorted(trace.starts, flat, side="right") - 1
    return ids, flat - trace.starts[ids]


class _Mapper:
    """`fused_experts`' work: one ``SwitchLinear`` at a time."""

    def __init__(self, model: nn.Module, paths):
        self.model, self.trace, self.module_of = model, paths.trace, paths.module_of
        self.found: dict[str, Fused] = {}
        self.refused: dict[str, str] = {}

    def leaves(self, module: str) -> dict[str, str]:
        """{role: checkpoint leaf} of the per-expert tensors of HF module ``module``."""
        out = {}
        for hf in self.module_of.values():
            m = _PER_EXPERT.match(hf)
            if m and m["module"] == module and m["leaf"] in _ROLES:
                out.setdefault(_ROLES[m["leaf"]], m["leaf"])
        return out

    def add(self, path: str) -> None:
        layer = get(self.model, path)
        if type(layer).__name__ != "SwitchLinear":
            self.refused[path] = (f"{path} is a quantized SwitchLinear; load the float32/bf16 "
                                  "checkpoint instead of an MLX-quantized one")
            return
        # taken out of the trace, so its markers are freed once this layer is mapped
        arr = None if self.trace is None else self.trace.take(f"{path}.weight")
        tensors = None if arr is None else self.trace.sources(arr)
        if not tensors:
            self.refused[path] = f"mlx-lm's {path} holds no per-expert checkpoint tensors"
            return
        hf = [_PER_EXPERT.match(self.module_of[t].removesuffix(".weight")) for t in tensors]
        if not all(hf) or len({(m["module"], m["leaf"]) for m in hf}) != 1 or \
                hf[0]["leaf"] not in _ROLES:
            what = ", ".join(tensors[:2])
            self.refused[path] = (f"mlx-lm's {path} holds {what}, not one per-expert weight of "
                                  "every expert (a checkpoint that stores the experts fused)")
            return
        self._place(path, arr, hf[0]["module"], hf[0]["leaf"])

    def _place(self, path: str, arr: mx.array, module: str, leaf: str) -> None:
        roles = self.leaves(module)
        role = _ROLES[leaf]
        gated = role in ("gate", "up") and {"gate", "up"} <= set(roles)
        param = f"{module}.{'gate_up_proj' if gated else leaf if role != 'down' else 'down_proj'}"
        sizes = {r: self.trace.shapes[self._tensor(module, 0, lf)] for r, lf in roles.items()}
        n_exp, _, n_in = arr.shape
        offset = sizes["gate"][0] if role == "up" and gated else 0
        out = sizes["gate"][0] + sizes["up"][0] if gated else sizes[role][0]
        first, last = arr[..., 0], arr[..., -1]
        ids, pos = _decode(self.trace, first)
        ids_l, pos_l = _decode(self.trace, last)
        experts = np.array([int(_PER_EXPERT.match(self.module_of[self.trace.names[i]]
                                                  .removesuffix(".weight"))["e"])
                            for i in ids.reshape(-1)]).reshape(ids.shape)
        row, col = np.divmod(pos, n_in)
        if (not (experts == np.arange(n_exp)[:, None]).all() or (col != 0).any()
                or (ids_l != ids).any() or (pos_l != pos + n_in - 1).any()
                or sizes[role][1] != n_in):
            self.refused[path] = (f"mlx-lm stores the experts of {module} ({path}) in another "
                                  "order than the checkpoint")
            return
        fused = self.found.setdefault(param, Fused(param, (n_exp, out, n_in)))
        fused.parts.append(Part(path, (row + offset).astype(np.int32)))

    def _tensor(self, module: str, e: int, leaf: str) -> str:
        want = f"{module}.{e}.{leaf}"
        return next(n for n, hf in self.module_of.items() if hf == want and n in
                    self.trace.shapes)


def get(model: nn.Module, path: str) -> nn.Module:
    m = model
    for part in path.split("."):
        m = m[int(part)] if isinstance(m, list) else m[part]
    return m


def fused_experts(model: nn.Module, paths) -> tuple[dict[str, Fused], dict[str, str]]:
    """({transformers fused expert weight path: `Fused`}, {MLX SwitchLinear path: why
    it cannot get peft's LoRA}) of an mlx-lm model; ``paths`` is its
    `yeto.mlx.hf_paths.HFPaths` (the trace and the checkpoint-to-HF renames)."""
    mapper = _Mapper(model, paths)
    for path in _switch_layers(model):
        mapper.add(path)
    return mapper.found, mapper.refused


def refusal(why: str) -> str:
    return (f"{why}, so a LoRA on the experts cannot be the same on the torch and MLX islands. "
            f"Leave the experts out, e.g. {FLAG} attention")


class _Ref:
    """A reference the MLX module tree does not follow (no parameter is shared)."""

    def __init__(self, module: nn.Module):
        self.module = module


class ExpertLoRA(nn.Module):
    """A frozen ``SwitchLinear`` plus peft's LoRA on the fused expert weight it is a
    part of (see the module docstring). The first part of a fused weight holds its
    lora_A (r·E, in) and lora_B (out, r·E); the others use those."""

    def __init__(self, base: nn.Module, rows: np.ndarray, owner: ExpertLoRA | None = None, *,
                 shape: tuple[int, int, int] = (0, 0, 0), r: int = 0, alpha: float = 0.0,
                 key: mx.array | None = None, hf_path: str | None = None, param: str = ""):
        super().__init__()
        base.freeze()
        self.base_layer = base
        self.rows = mx.array(rows)
        self.freeze(keys=["rows"], recurse=False)
        self.owner = None if owner is None else _Ref(owner)
        self.hf_path = hf_path if owner is None else None
        #: the transformers fused weight this adapts (``mlp.experts.gate_up_proj``)
        self.param = param
        if owner is None:
            n_exp, out, n_in = shape
            self.lora_A = nn.Linear(n_in, r * n_exp, bias=False)
            self.lora_B = nn.Linear(r * n_exp, out, bias=False)
            bound = 1.0 / math.sqrt(n_in)
            self.lora_A.weight = mx.random.uniform(-bound, bound, (r * n_exp, n_in), key=key)
            self.lora_B.weight = mx.zeros((out, r * n_exp))
            self.num_experts, self.r, self.alpha = n_exp, int(r), float(alpha)
            self.scaling = self.alpha / self.r

    def factors(self) -> tuple[mx.array, mx.array]:
        """(A (E, r, in), B (E, rows, r)) of this part, in peft's layout."""
        o = self if self.owner is None else self.owner.module
        n_exp, r = o.num_experts, o.r
        a = o.lora_A.weight.reshape(n_exp, r, -1)
        b = o.lora_B.weight.reshape(-1, r, n_exp).transpose(2, 0, 1)  # (E, out, r)
        return a, mx.take_along_axis(b, self.rows[..., None], axis=1)

    def __call__(self, x, indices, sorted_indices=False):
        o = self if self.owner is None else self.owner.module
        y = self.base_layer(x, indices, sorted_indices=sorted_indices)
        a, b = self.factors()
        z = mx.gather_mm(x, a.swapaxes(-1, -2), rhs_indices=indices,
                         sorted_indices=sorted_indices)
        z = mx.gather_mm(z, b.swapaxes(-1, -2), rhs_indices=indices,
                         sorted_indices=sorted_indices)
        return y + (o.scaling * z).astype(y.dtype)


# ---- adapter files ------------------------------------------------------------
def model_experts(model_dir) -> tuple[dict[str, Fused], dict[str, str]]:
    """`fused_experts` of the mlx-lm model in ``model_dir`` (loaded lazily: shapes
    and the marker trace only)."""
    from yeto.mlx.hf_paths import HFPaths, hf_weight_names
    from yeto.mlx.load import load_model, read_config

    model, _ = load_model(model_dir, lazy=True)
    return fused_experts(model, HFPaths(model, hf_weight_names(model_dir), read_config(model_dir)))


def mlx_lm_factors(a: np.ndarray, b: np.ndarray, fused: Fused
                   ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """peft's lora_A (r·E, in) / lora_B (out, r·E) of a fused expert weight as
    mlx-lm's ``LoRASwitchLinear`` factors of each part: {MLX module path: (lora_a
    (E, r, in), lora_b (E, rows, r))}, so that lora_b[e] @ lora_a[e] is rows of
    peft's B_e·A_e (same scale)."""
    n_exp, out, n_in = fused.shape
    if a.shape[1] != n_in or b.shape[0] != out or a.shape[0] != b.shape[1] or \
            a.shape[0] % n_exp:
        raise ValueError(f"{fused.param}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not "
                         f"fit {n_exp} experts of ({out}, {n_in})")
    r = a.shape[0] // n_exp
    lora_a = a.reshape(n_exp, r, n_in)
    per_expert = b.reshape(out, r, n_exp).transpose(2, 0, 1)  # (E, out, r)
    return {p.module: (np.ascontiguousarray(lora_a),
                       np.ascontiguousarray(np.take_along_axis(per_expert, p.rows[..., None],
                                                               axis=1)))
            for p in fused.parts}


def peft_factors(switch: dict[str, tuple[np.ndarray, np.ndarray]], fused: Fused
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `mlx_lm_factors`: peft's lora_A (r·E, in) and lora_B (out, r·E)
    from the ``LoRASwitchLinear`` factors ({MLX module path: (lora_a, lora_b)}) of
    every part of ``fused``; the parts must share lora_a (one peft LoRA per fused
    weight) and cover all its rows."""
    n_exp, out, n_in = fused.shape
    missing = [p.module for p in fused.parts if p.module not in switch]
    if missing:
        raise ValueError(f"{fused.param}: no LoRA on {', '.join(missing)}")
    lora_a = switch[fused.parts[0].module][0]
    r = lora_a.shape[1]
    per_expert = np.full((n_exp, out, r), np.nan, dtype=np.float32)
    for p in fused.parts:
        a, b = switch[p.module]
        if not np.array_equal(a, lora_a):
            raise ValueError(f"{fused.param}: {p.module} has its own lora_a; one peft LoRA on "
                             "the fused weight has one A for all its parts")
        np.put_along_axis(per_expert, p.rows[..., None], b, axis=1)
    if np.isnan(per_expert).any() or lora_a.shape != (n_exp, r, n_in):
        raise ValueError(f"{fused.param}: the parts do not cover ({n_exp}, {out}, {n_in})")
    b = per_expert.transpose(1, 2, 0).reshape(out, r * n_exp)
    return np.ascontiguousarray(lora_a.reshape(r * n_exp, n_in)), np.ascontiguousarray(b)
