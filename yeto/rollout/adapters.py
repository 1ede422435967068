"""Adapters a rollout node loads: a peft **or** an mlx-lm adapter directory, read as
peft-named tensors (the conversion is `yeto.interop.adapters`', exact), plus the
LoRA shape that must be attached to hold them (`LoraSpec`)."""

from __future__ import annotations

import math
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError

from yeto.interop.adapters import (
    MLX_WEIGHTS,
    PEFT_WEIGHTS,
    AdapterConversionError,
    mlx_to_peft,
    read_peft_adapter,
    scale_problem,
    values_problem,
)

_MODULE = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


@dataclass(frozen=True)
class LoraSpec:
    """The LoRA a node attaches: rank, alpha and target selection (a `--lora-targets`
    value: a mode, or a comma list of module paths)."""

    r: int = 16
    alpha: float = 32.0
    targets: str = "auto"


class AdapterError(ValueError):
    """An adapter directory that cannot be loaded, and why."""


def adapter_format(path: str | Path) -> str:
    """"peft" or "mlx" (mlx-lm), from the files in `path`."""
    d = Path(path)
    if (d / PEFT_WEIGHTS).is_file():
        return "peft"
    if (d / MLX_WEIGHTS).is_file():
        return "mlx"
    raise AdapterError(f"{d} is not an adapter directory: it holds neither {PEFT_WEIGHTS} "
                       f"(peft) nor {MLX_WEIGHTS} (mlx-lm)")


def read_adapter(path: str | Path, base_model: str | Path
                 ) -> tuple[dict[str, np.ndarray], LoraSpec, str]:
    """(peft-named float32 tensors, the LoRA that holds them, "peft" | "mlx"). Refuses
    (`AdapterError`) unreadable files, a nonsense config (a LoRA scale beyond
    `MAX_LORA_SCALE` included), unpaired or misshapen LoRA factors, and values that are
    non-finite or beyond `MAX_FACTOR_ABS` (`yeto.interop.adapters`)."""
    kind = adapter_format(path)
    try:
        if kind == "mlx":
            with tempfile.TemporaryDirectory(prefix="yeto-adapter-") as tmp:
                tensors, cfg = read_peft_adapter(mlx_to_peft(path, tmp, base_model))
        else:
            tensors, cfg = read_peft_adapter(path)
        tensors = {k: np.asarray(v, np.float32) for k, v in tensors.items()}
    except (AdapterConversionError, SafetensorError, OSError, ValueError, TypeError,
            KeyError) as e:
        raise AdapterError(f"cannot load the adapter at {path}: {e}") from e
    if not isinstance(cfg, dict):
        raise AdapterError(f"the adapter at {path}: adapter_config.json is not a JSON object")
    for name, t in tensors.items():
        problem = values_problem(name, t)
        if problem:
            raise AdapterError(f"the adapter at {path}: {problem}; it would sample garbage: "
                               "fix or retrain it")
    return tensors, spec_of(tensors, cfg), kind


def _rank_alpha(cfg: dict) -> tuple[int, float]:
    """The config's r (an integer >= 1) and lora_alpha (a finite number > 0)."""
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise AdapterError(f"adapter_config.json: r must be an integer >= 1, got {r!r}")
    if (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
            or not math.isfinite(alpha) or alpha <= 0):
        raise AdapterError(f"adapter_config.json: lora_alpha must be a finite number > 0, "
                           f"got {alpha!r}")
    problem = scale_problem(cfg)
    if problem:
        raise AdapterError(f"adapter_config.json: {problem}")
    return r, float(alpha)


def _check_factors(tensors: dict[str, np.ndarray], r: int) -> set[str]:
    """The adapted module paths; every module has lora_A (r, in) and lora_B (out, r)."""
    factors: dict[str, dict[str, np.ndarray]] = {}
    for name, t in tensors.items():
        m = _MODULE.match(name)
        if m is None:
            raise AdapterError(f"tensor {name} is not a LoRA factor (base_model.model.<module>."
                               "lora_A/B.weight); rollout nodes serve plain LoRA adapters")
        factors.setdefault(m["module"], {})[m["ab"]] = t
    for module, ab in sorted(factors.items()):
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise AdapterError(f"{module} has no {missing}: the adapter is incomplete")
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != r or b.shape[1] != r:
            raise AdapterError(f"{module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} "
                               f"are not (r, in) and (out, r) for the config's r={r}")
    return set(factors)


def spec_of(tensors: dict[str, np.ndarray], cfg: dict) -> LoraSpec:
    """The LoRA shape of a peft adapter: its r and alpha, and exactly the module
    paths it adapts as targets."""
    for key in ("use_rslora", "use_dora"):
        if cfg.get(key):
            raise AdapterError(f"the adapter uses {key}; rollout nodes serve plain LoRA")
    for key in ("alpha_pattern", "rank_pattern"):
        if cfg.get(key):  # served with one alpha and r, those modules would sample wrong
            some = ", ".join(sorted(map(str, cfg[key]))[:3])
            raise AdapterError(f"the adapter sets {key} (for {some}): rollout nodes serve one "
                               "lora_alpha and r for every module; export it without "
                               "per-module values")
    r, alpha = _rank_alpha(cfg)
    modules = _check_factors(tensors, r)
    if not modules:
        raise AdapterError("the adapter holds no LoRA tensors")
    return LoraSpec(r, alpha, ",".join(sorted(modules)))


def flat_of(tensors: dict[str, np.ndarray], layout) -> np.ndarray:
    """The adapter as the flat vector of `layout` (canonical order); refuses an adapter
    whose tensors are not exactly the layout's."""
    names = {s.name for s in layout.specs}
    if set(tensors) != names:
        extra, missing = sorted(set(tensors) - names), sorted(names - set(tensors))
        raise AdapterError(f"the adapter's tensors differ from the model's LoRA (e.g. extra "
                           f"{extra[:1]}, missing {missing[:1]})")
    parts = []
    for s in layout.specs:
        t = tensors[s.name]
        if tuple(t.shape) != tuple(s.shape):
            raise AdapterError(f"{s.name} has shape {list(t.shape)}, the model's LoRA "
                               f"{list(s.shape)}")
        parts.append(np.asarray(t, np.float32).reshape(-1))
    return np.concatenate(parts)
