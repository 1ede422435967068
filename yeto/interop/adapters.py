"""LoRA adapters on disk: peft's layout and mlx-lm's, and exact conversion.

peft (what every yeto island and the syncer write)::

    adapter_model.safetensors   base_model.model.<module>.lora_A.weight  (r, in)
                                base_model.model.<module>.lora_B.weight  (out, r)
    adapter_config.json         LoraConfig: r, lora_alpha, target_modules, ...
    forward: y = W x + (lora_alpha / r) · B A x

mlx-lm 0.32 (`mlx_lm.load(model, adapter_path=DIR)`, see
``mlx_lm/tuner/utils.py``: ``load_adapters`` and ``linear_to_lora_layers``)::

    adapters.safetensors        <module>.lora_a  (in, r)   = Aᵀ
                                <module>.lora_b  (r, out)  = Bᵀ
    adapter_config.json         fine_tune_type "lora", num_layers N (LoRA goes on
                                the *last* N blocks), lora_parameters {rank, scale,
                                dropout, keys}: keys are module paths relative to a
                                block, e.g. "self_attn.q_proj"
    forward: y = W x + scale · (x lora_a) lora_b,   scale = lora_alpha / r

The conversion is exact (a transpose; the numbers are copied bit for bit). What
the mlx-lm layout cannot express is refused with `AdapterConversionError`: rsLoRA,
DoRA, per-module rank or alpha patterns, LoRA biases, extra saved modules, and
adapted blocks that are not the last N blocks with the same keys in each.
``peft_to_mlx`` keeps the peft config inside the mlx-lm config (key
``peft_config``, which mlx-lm ignores), so peft -> mlx -> peft gives the same
adapter back, config included.

Backend-neutral: numpy + safetensors; nothing here imports torch, peft or mlx.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from yeto.io import atomic_save, atomic_write
from yeto.targets import expert_lora_module

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
MLX_WEIGHTS = "adapters.safetensors"
MLX_CONFIG = "adapter_config.json"

_PEFT_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")
_MLX_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[ab])$")
_BLOCK = re.compile(r"^(?P<prefix>(?:.+\.)?layers)\.(?P<index>\d+)\.(?P<key>.+)$")

# peft config fields whose non-default value changes the function or the tensors
# in a way mlx-lm's LoRA cannot reproduce: (key, allowed values, what it is).
_REFUSED = (
    ("use_rslora", (False, None), "rsLoRA (scale alpha/sqrt(r))"),
    ("use_dora", (False, None), "DoRA"),
    ("rank_pattern", ({}, None), "per-module ranks (rank_pattern)"),
    ("alpha_pattern", ({}, None), "per-module alphas (alpha_pattern)"),
    ("lora_bias", (False, None), "LoRA biases (lora_bias)"),
    ("bias", ("none", None), "trained biases (bias)"),
    ("fan_in_fan_out", (False, None), "fan_in_fan_out weights"),
    ("modules_to_save", (None, []), "fully trained extra modules (modules_to_save)"),
    ("target_parameters", (None, []), "LoRA on parameters (target_parameters)"),
    ("trainable_token_indices", (None,), "trainable token indices"),
    ("layer_replication", (None,), "layer replication"),
    ("use_qalora", (False, None), "QA-LoRA"),
    ("use_bdlora", (False, None), "BD-LoRA"),
    ("alora_invocation_tokens", (None,), "activated LoRA (alora_invocation_tokens)"),
)


class AdapterConversionError(ValueError):
    """An adapter that cannot be converted exactly, and why."""


# ---- sane values --------------------------------------------------------------
# What every reader of an adapter (a rollout node, `yeto export`, `yeto convert`)
# accepts. Trained LoRA factors hold values well below 1 (kaiming-initialised A,
# B grown from zero), and LoRA scales (lora_alpha / r) are small numbers such as 2;
# an adapter beyond these bounds is broken or hostile: finite, but it would make a
# model's logits overflow to inf and NaN.
MAX_FACTOR_ABS = 1e4   # |value| of any LoRA factor
MAX_LORA_SCALE = 1e4   # |lora_alpha / r| (mlx-lm: |lora_parameters.scale|)


def values_problem(name: str, values: np.ndarray) -> str | None:
    """What makes tensor `name`'s values unusable (NaN / inf, or a magnitude beyond
    `MAX_FACTOR_ABS`), as a phrase naming the tensor and the bound; None when fine."""
    a = np.asarray(values)
    if not np.issubdtype(a.dtype, np.inexact) or a.size == 0:
        return None
    bad = int(a.size - np.count_nonzero(np.isfinite(a)))
    if bad:
        return f"tensor {name} holds {bad} non-finite values (NaN or infinite)"
    top = float(np.abs(a).max())
    if top > MAX_FACTOR_ABS:
        return (f"tensor {name} holds a value of magnitude {top:.3g}, beyond the bound "
                f"{MAX_FACTOR_ABS:g} on LoRA factors (trained ones stay far below 1)")
    return None


def scale_problem(cfg: dict) -> str | None:
    """What makes an adapter config's LoRA scale unusable, as a phrase naming the
    adapter_config.json field and the bound `MAX_LORA_SCALE`; None when fine. peft:
    lora_alpha / r (and every alpha_pattern entry / r); mlx-lm: lora_parameters.scale.
    A missing or non-numeric field is left to the format's own checks."""
    lp = cfg.get("lora_parameters")
    if isinstance(lp, dict):  # mlx-lm
        scales = {"lora_parameters.scale": (lp.get("scale"), 1)}
    else:
        r = cfg.get("r")
        alphas = cfg.get("alpha_pattern") if isinstance(cfg.get("alpha_pattern"), dict) else {}
        scales = {"lora_alpha": (cfg.get("lora_alpha"), r),
                  **{f"alpha_pattern[{k!r}]": (v, r) for k, v in alphas.items()}}
    for field, (value, divisor) in scales.items():
        if not _number(value) or not _number(divisor) or divisor == 0:
            continue
        try:
            scale = abs(value) / abs(divisor)
        except OverflowError:  # an integer beyond any float
            scale = math.inf
        if not scale <= MAX_LORA_SCALE:  # NaN fails too
            return (f"{field} = {value!r:.40} gives a LoRA scale of {scale:.3g}, beyond the "
                    f"bound {MAX_LORA_SCALE:g} (trained adapters use scales such as 2: "
                    "lora_alpha = 2 r)")
    return None


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# ---- peft ---------------------------------------------------------------------
PEFT_VERSION = "0.21.2"  # the peft release whose adapter_config.json _LORA_DEFAULTS mirror
# Every field of peft's LoraConfig.to_dict() (peft 0.21.2) that yeto's settings leave at
# peft's default, as save_pretrained writes them (inference_mode is True once saved).
# tests/integration/test_adapters.py compares the whole file with what the installed peft writes,
# so a peft upgrade that changes the fields fails there, not silently.
_LORA_DEFAULTS: dict[str, Any] = {
    "alora_invocation_tokens": None, "alpha_pattern": {}, "arrow_config": None,
    "auto_mapping": None, "bias": "none", "corda_config": None, "ensure_weight_tying": False,
    "eva_config": None, "exclude_modules": None, "fan_in_fan_out": False,
    "inference_mode": True, "init_lora_weights": True, "kasa_config": None,
    "layer_replication": None, "layers_pattern": None, "layers_to_transform": None,
    "loftq_config": {}, "lora_bias": False, "lora_ga_config": None, "megatron_config": None,
    "megatron_core": "megatron.core", "modules_to_save": None, "monteclora_config": None,
    "peft_type": "LORA", "peft_version": PEFT_VERSION, "qalora_group_size": 16,
    "rank_pattern": {}, "revision": None, "target_parameters": None,
    "task_type": "CAUSAL_LM", "trainable_token_indices": None, "use_bdlora": None,
    "use_dora": False, "use_qalora": False, "use_rslora": False, "velora_config": None,
}  # fmt: skip


def peft_adapter_config(base_model: str, r: int, alpha: float, target_modules,
                        lora_dropout: float = 0.0, target_parameters=None) -> str:
    """adapter_config.json text: what peft's ``save_pretrained`` writes for
    ``LoraConfig(r, lora_alpha, target_modules, lora_dropout, bias="none",
    task_type="CAUSAL_LM")`` on a model loaded from ``base_model``, the settings of
    every yeto island. The one producer of this file (torch island, MLX island,
    `MLXDiLoCo`, `mlx_to_peft`); imports neither torch nor peft, so every island
    writes the same text. ``target_modules`` is written sorted (peft writes its set
    in hash order). ``target_parameters``: the fused expert weights adapted with
    peft's ``target_parameters`` (`yeto.targets.select_experts`), written sorted as
    yeto passes them to peft; ``target_modules`` is then null when empty, as peft
    writes it."""
    if isinstance(target_modules, str) or isinstance(target_parameters, str):
        raise TypeError("target_modules / target_parameters must be lists of paths, not a string")
    modules = sorted(target_modules or [])
    out = dict(_LORA_DEFAULTS, base_model_name_or_path=str(base_model), r=int(r),
               lora_alpha=alpha, lora_dropout=lora_dropout,
               target_modules=modules or (None if target_parameters else []),
               target_parameters=sorted(target_parameters) if target_parameters else None)
    return json.dumps(out, indent=2, sort_keys=True)


def save_peft_adapter(out_dir: str | Path, tensors: dict[str, np.ndarray],
                      config_text: str) -> Path:
    """Write ``adapter_model.safetensors`` (float32, peft's metadata) and
    ``adapter_config.json``; loads with ``peft.PeftModel.from_pretrained``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _save_safetensors(out / PEFT_WEIGHTS, tensors, {"format": "pt"})
    atomic_write(out / PEFT_CONFIG, config_text)
    return out


def read_peft_adapter(peft_dir: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    from safetensors.numpy import load_file

    d = Path(peft_dir)
    for f in (PEFT_WEIGHTS, PEFT_CONFIG):
        if not (d / f).is_file():
            raise FileNotFoundError(f"{d / f} not found: {d} is not a peft adapter dir "
                                    f"({PEFT_WEIGHTS} + {PEFT_CONFIG})")
    return load_file(str(d / PEFT_WEIGHTS)), json.loads((d / PEFT_CONFIG).read_text())


# ---- peft -> mlx-lm ---------------------------------------------------------------
def peft_to_mlx(peft_dir: str | Path, out_dir: str | Path,
                base_model: str | Path | None = None) -> Path:
    """Convert a peft LoRA adapter to mlx-lm's layout, exactly.

    ``base_model`` (a local model dir) gives the number of blocks, because mlx-lm
    puts LoRA on the *last* ``num_layers`` blocks; default: the adapter's
    ``base_model_name_or_path``. Raises `AdapterConversionError` for what mlx-lm
    cannot express exactly.
    """
    tensors, cfg = read_peft_adapter(peft_dir)
    _check_peft_config(cfg, peft_dir)
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    experts = _expert_modules(cfg)
    factors = _peft_factors({k: v for k, v in tensors.items() if _module(k) not in experts},
                            r, peft_dir, allow_empty=bool(experts))
    switch = _switch_factors(tensors, experts, base_model, cfg, peft_dir)
    num_layers, keys = _block_coverage(sorted([*factors, *switch]),
                                       _num_blocks(base_model, cfg),
                                       _layer_types(base_model, cfg))
    out_tensors: dict[str, np.ndarray] = {}
    for module, (a, b) in factors.items():
        out_tensors[f"{module}.lora_a"] = np.ascontiguousarray(a.T)
        out_tensors[f"{module}.lora_b"] = np.ascontiguousarray(b.T)
    for module, (a, b) in switch.items():  # LoRASwitchLinear: (E, r, in), (E, out, r)
        out_tensors[f"{module}.lora_a"], out_tensors[f"{module}.lora_b"] = a, b
    config = {
        "fine_tune_type": "lora",
        "model": cfg.get("base_model_name_or_path"),
        "num_layers": num_layers,
        "lora_parameters": {"rank": r, "scale": alpha / r,
                            "dropout": float(cfg.get("lora_dropout") or 0.0), "keys": keys},
        "peft_config": cfg,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _save_safetensors(out / MLX_WEIGHTS, out_tensors, {"format": "mlx"})
    atomic_write(out / MLX_CONFIG, json.dumps(config, indent=2, sort_keys=True))
    return out


def _module(peft_key: str) -> str | None:
    m = _PEFT_KEY.match(peft_key)
    return m["module"] if m else None


def _expert_modules(cfg: dict) -> dict[str, str]:
    """{module path peft saves a fused expert weight's LoRA under: the weight's path}
    (`yeto.targets.expert_lora_module`), from ``target_parameters``."""
    params = [str(p) for p in cfg.get("target_parameters") or []]
    return {expert_lora_module(p, params): p for p in params}


def _switch_factors(tensors: dict[str, np.ndarray], experts: dict[str, str], base_model,
                    cfg: dict, where) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """peft's LoRA on fused expert weights as mlx-lm ``LoRASwitchLinear`` factors,
    {MLX module path: (lora_a, lora_b)} (`yeto.mlx.experts.mlx_lm_factors`). Which
    ``SwitchLinear`` holds which rows is read from the mlx-lm model itself, so this
    needs mlx-lm and the local base model."""
    if not experts:
        return {}
    base = base_model if base_model is not None else cfg.get("base_model_name_or_path")
    if not base or not (Path(str(base)) / "config.json").is_file():
        raise AdapterConversionError(
            f"{where}: LoRA on fused expert weights converts to mlx-lm only with the local "
            "base model (where mlx-lm keeps the experts): pass base_model=PATH, e.g. "
            "yeto convert ADAPTER --to mlx --base-model runs/demo/model")
    try:
        from yeto.mlx.experts import mlx_lm_factors, model_experts
    except ImportError as e:
        raise AdapterConversionError(f"{where}: LoRA on fused expert weights converts to mlx-lm "
                                     f"only where mlx-lm is installed ({e})") from e
    found, refused = model_experts(Path(str(base)))
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for module, param in experts.items():
        a = tensors.get(f"base_model.model.{module}.lora_A.weight")
        b = tensors.get(f"base_model.model.{module}.lora_B.weight")
        if a is None or b is None:
            raise AdapterConversionError(f"{where}: target_parameters names {param}, but the "
                                         f"adapter has no lora_A/lora_B under {module}")
        if param not in found:
            why = next(iter(refused.values()), "mlx-lm keeps no SwitchLinear for it")
            raise AdapterConversionError(f"{where}: {param}: {why}")
        try:
            out.update(mlx_lm_factors(a, b, found[param]))
        except ValueError as e:
            raise AdapterConversionError(f"{where}: {e}") from e
    return out


def _check_peft_config(cfg: dict, where) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterConversionError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LoRA; "
                                     "only LoRA adapters convert to mlx-lm")
    for key, allowed, what in _REFUSED:
        if key == "target_parameters" and all(
                str(p).rsplit(".", 2)[-2:-1] == ["experts"] for p in cfg.get(key) or []):
            continue  # fused expert weights: mlx-lm's LoRASwitchLinear (`_switch_factors`)
        if key in cfg and cfg[key] not in allowed:
            raise AdapterConversionError(
                f"{where}: {what} is set ({key}={cfg[key]!r}); mlx-lm's LoRA cannot express it "
                "exactly, so it is not converted. Train with plain LoRA (e.g. the yeto islands' "
                "defaults) to get an adapter that converts")
    if not isinstance(cfg.get("r"), int) or cfg["r"] < 1 or "lora_alpha" not in cfg:
        raise AdapterConversionError(f"{where}: adapter_config.json lacks a valid r / lora_alpha")


def _peft_factors(tensors: dict[str, np.ndarray], r: int, where, allow_empty: bool = False
                  ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    parts: dict[str, dict[str, np.ndarray]] = {}
    for name, t in tensors.items():
        m = _PEFT_KEY.match(name)
        if m is None:
            raise AdapterConversionError(
                f"{where}: tensor {name} is not a LoRA factor of a linear layer "
                "(base_model.model.<module>.lora_A/B.weight); embeddings, DoRA magnitudes, "
                "biases and saved modules do not convert to mlx-lm")
        parts.setdefault(m["module"], {})[m["which"]] = t
    out = {}
    for module, p in parts.items():
        if set(p) != {"A", "B"}:
            raise AdapterConversionError(f"{where}: {module} has only lora_{''.join(p)}")
        a, b = p["A"], p["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterConversionError(f"{where}: {module}: lora_A {list(a.shape)} and lora_B "
                                         f"{list(b.shape)} are not (r, in) and (out, r)")
        if a.shape[0] != r:
            raise AdapterConversionError(
                f"{where}: {module} has rank {a.shape[0]}, the config says r={r}; per-module "
                "ranks do not convert to mlx-lm (one rank for all layers)")
        out[module] = (a, b)
    if not out and not allow_empty:
        raise AdapterConversionError(f"{where}: the adapter holds no LoRA tensors")
    return out


def _num_blocks(base_model, cfg: dict) -> int | None:
    base = base_model if base_model is not None else cfg.get("base_model_name_or_path")
    path = Path(str(base)) / "config.json" if base else None
    if path is None or not path.is_file():
        if base_model is not None:
            raise AdapterConversionError(f"{path} not found: base_model must be a local model dir")
        return None
    hf = json.loads(path.read_text())
    for c in (hf, hf.get("text_config") or {}):
        for k in ("num_hidden_layers", "n_layer", "num_layers"):
            if isinstance(c.get(k), int):
                return c[k]
    raise AdapterConversionError(f"{path} has no num_hidden_layers: cannot count the blocks")


def _layer_types(base_model, cfg: dict) -> list[str]:
    """The base model's per-block kinds (`layer_types`: LFM2's conv / full_attention),
    [] when it has none or is not local."""
    base = base_model if base_model is not None else cfg.get("base_model_name_or_path")
    path = Path(str(base)) / "config.json" if base else None
    if path is None or not path.is_file():
        return []
    hf = json.loads(path.read_text())
    return [str(t) for t in (hf.get("layer_types") or (hf.get("text_config") or {})
                             .get("layer_types") or ())]


def _block_coverage(modules: list[str], total: int | None,
                    layer_types: list[str] = ()) -> tuple[int, list[str]]:
    """(num_layers, keys) for mlx-lm, or refuse. Blocks of one kind must adapt the
    same modules; on hybrid models (several `layer_types`) the key list is the union
    of the kinds' lists: mlx-lm adapts in each block the keys that block has, and the
    kinds' modules differ (conv.* vs self_attn.*)."""
    by_layer: dict[int, set[str]] = {}
    prefixes = set()
    for module in modules:
        m = _BLOCK.match(module)
        if m is None:
            raise AdapterConversionError(
                f"LoRA on {module}, outside the decoder blocks (<...>.layers.<i>.<module>): "
                "mlx-lm adapts only modules inside blocks")
        prefixes.add(m["prefix"])
        by_layer.setdefault(int(m["index"]), set()).add(m["key"])
    if len(prefixes) != 1:
        raise AdapterConversionError(f"LoRA spans several block lists {sorted(prefixes)}")
    layers = sorted(by_layer)
    kind = (lambda i: layer_types[i]) if len(set(layer_types)) > 1 else (lambda i: "")
    first: dict[str, int] = {}
    for i in layers:
        j = first.setdefault(kind(i), i)
        if by_layer[i] != by_layer[j]:
            diff = sorted(by_layer[i] ^ by_layer[j])
            raise AdapterConversionError(
                f"block {i} adapts different modules than block {j} (differ: "
                f"{', '.join(diff)}); mlx-lm uses one key list for all adapted blocks")
    keys = set().union(*by_layer.values())
    if total is None:
        raise AdapterConversionError(
            "cannot count the base model's blocks (mlx-lm adapts the *last* num_layers "
            "blocks): pass base_model=PATH of the local model dir, e.g. "
            "peft_to_mlx(adapter, out, base_model='runs/demo/model')")
    if layers[-1] >= total:
        raise AdapterConversionError(f"the adapter has block {layers[-1]} but the base model "
                                     f"has {total} blocks: wrong base_model?")
    expected = list(range(total - len(layers), total))
    if layers != expected:
        raise AdapterConversionError(
            f"adapted blocks {_ranges(layers)} are not the last {len(layers)} of {total} "
            f"(mlx-lm puts LoRA on blocks {_ranges(expected)}): not convertible exactly")
    return len(layers), sorted(keys)


def _ranges(xs: list[int]) -> str:
    out, start = [], xs[0]
    for a, b in zip(xs, xs[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


# ---- mlx-lm -> peft ---------------------------------------------------------------
def mlx_to_peft(mlx_dir: str | Path, out_dir: str | Path, base_model: str | Path) -> Path:
    """Convert an mlx-lm LoRA adapter to a peft adapter on ``base_model``, exactly.

    The peft config kept by `peft_to_mlx` is restored when present (so a round trip
    gives the same config); otherwise one is written with ``lora_alpha = scale·r``
    and the adapted module paths as ``target_modules``.
    """
    from safetensors.numpy import load_file

    d = Path(mlx_dir)
    for f in (MLX_WEIGHTS, MLX_CONFIG):
        if not (d / f).is_file():
            raise FileNotFoundError(f"{d / f} not found: {d} is not an mlx-lm adapter dir "
                                    f"({MLX_WEIGHTS} + {MLX_CONFIG})")
    cfg = json.loads((d / MLX_CONFIG).read_text())
    kind = cfg.get("fine_tune_type", "dora" if cfg.get("use_dora") else "lora")
    if kind != "lora":
        raise AdapterConversionError(f"{d}: fine_tune_type {kind!r}: only plain LoRA adapters "
                                     "convert to peft exactly")
    lp = cfg.get("lora_parameters") or {}
    if "rank" not in lp or "scale" not in lp:
        raise AdapterConversionError(f"{d}: adapter_config.json lacks lora_parameters.rank/scale")
    r, scale = int(lp["rank"]), float(lp["scale"])
    parts: dict[str, dict[str, np.ndarray]] = {}
    for name, t in load_file(str(d / MLX_WEIGHTS)).items():
        m = _MLX_KEY.match(name)
        if m is None:
            raise AdapterConversionError(
                f"{d}: tensor {name} is not a LoRA factor (<module>.lora_a/lora_b); DoRA "
                "magnitudes and fully trained weights do not convert to peft LoRA")
        parts.setdefault(m["module"], {})[m["which"]] = t
    for module, p in parts.items():
        if set(p) != {"a", "b"}:
            raise AdapterConversionError(f"{d}: {module} has only lora_{''.join(p)}")
    switch = {m: p for m, p in parts.items() if p["a"].ndim == 3}
    parts = {m: p for m, p in parts.items() if m not in switch}
    tensors = _linear_factors(parts, r, d)
    kept = cfg.get("peft_config") if isinstance(cfg.get("peft_config"), dict) else {}
    params = [str(x) for x in kept.get("target_parameters") or []] if switch else []
    tensors.update(_switch_to_peft(switch, params, base_model, d))
    if not tensors:
        raise AdapterConversionError(f"{d}: the adapter holds no LoRA tensors")
    modules = sorted(parts)
    if kept and _matches(kept, modules, r, scale, params):
        peft_cfg = dict(kept)
        peft_cfg["base_model_name_or_path"] = str(base_model)
        text = json.dumps(peft_cfg, indent=2, sort_keys=True)
    else:
        text = peft_adapter_config(str(base_model), r, scale * r, modules,
                                   lora_dropout=float(lp.get("dropout") or 0.0),
                                   target_parameters=params)
    return save_peft_adapter(out_dir, tensors, text)


def _linear_factors(parts: dict, r: int, d) -> dict[str, np.ndarray]:
    """mlx-lm's lora_a (in, r) / lora_b (r, out) as peft's lora_A / lora_B."""
    tensors: dict[str, np.ndarray] = {}
    for module, p in sorted(parts.items()):
        a, b = p["a"], p["b"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != r or b.shape[0] != r:
            raise AdapterConversionError(
                f"{d}: {module}: lora_a {list(a.shape)} / lora_b {list(b.shape)} are not "
                f"(in, {r}) / ({r}, out); per-module-rank LoRA does not convert")
        tensors[f"base_model.model.{module}.lora_A.weight"] = np.ascontiguousarray(a.T)
        tensors[f"base_model.model.{module}.lora_B.weight"] = np.ascontiguousarray(b.T)
    return tensors


def _switch_to_peft(switch: dict, params: list[str], base_model, d) -> dict[str, np.ndarray]:
    """mlx-lm ``LoRASwitchLinear`` factors (per expert) as peft's LoRA on the fused
    expert weights named in the kept peft config (`yeto.mlx.experts.peft_factors`);
    refused where that config is missing (an adapter mlx-lm trained itself: its
    gate_proj and up_proj each have their own lora_a, which one peft LoRA on
    gate_up_proj cannot hold)."""
    if not switch:
        return {}
    if not params:
        raise AdapterConversionError(
            f"{d}: {next(iter(switch))} is a per-expert LoRA on a SwitchLinear, and the "
            "adapter does not say which transformers fused expert weight it adapts (only "
            "adapters converted from peft by yeto do); it does not convert")
    try:
        from yeto.mlx.experts import model_experts, peft_factors
    except ImportError as e:
        raise AdapterConversionError(f"{d}: LoRA on experts converts back to peft only where "
                                     f"mlx-lm is installed ({e})") from e
    found, _ = model_experts(Path(str(base_model)))
    out: dict[str, np.ndarray] = {}
    for param in params:
        if param not in found:
            raise AdapterConversionError(f"{d}: mlx-lm keeps no SwitchLinear for {param}")
        try:
            a, b = peft_factors({m: (p["a"], p["b"]) for m, p in switch.items()}, found[param])
        except ValueError as e:
            raise AdapterConversionError(f"{d}: {e}") from e
        module = expert_lora_module(param, params)
        out[f"base_model.model.{module}.lora_A.weight"] = a
        out[f"base_model.model.{module}.lora_B.weight"] = b
    return out


def _matches(peft_cfg: dict, modules: list[str], r: int, scale: float,
             params: list[str] = ()) -> bool:
    """Whether a kept peft config still describes these tensors."""
    if peft_cfg.get("r") != r or float(peft_cfg.get("lora_alpha", 0)) / r != scale:
        return False
    if sorted(peft_cfg.get("target_parameters") or []) != sorted(params):
        return False
    if not modules:
        return not peft_cfg.get("target_modules")
    tm = peft_cfg.get("target_modules")
    if isinstance(tm, str):
        return all(re.fullmatch(tm, m) for m in modules)
    if isinstance(tm, list):
        return all(any(m == t or m.endswith("." + t) for t in tm) for m in modules)
    return False


# ---- files --------------------------------------------------------------------
def _save_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict) -> None:
    from safetensors.numpy import save_file

    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    atomic_save(path, lambda tmp: save_file(arrays, str(tmp), metadata=metadata))
