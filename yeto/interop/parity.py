"""Do the torch island and the MLX island compute the same model?

Two checks, used by ``yeto check-parity`` (yeto.cli.parity) and ``scripts/arch_sweep.py``:

- **names**: the trainable LoRA tensors of the torch island (peft, `yeto.torch.model.
  attach_lora` + `TorchWeights`) and of the MLX island (`yeto.mlx.learner.
  build_lora_model` + `LoRAWeights`) have the same canonical names, shapes and flat
  order (`compare_layouts`). Shapes only: the torch model is built on the meta
  device and the MLX weights load lazily, so this is light for any model size.
- **logits**: the same seeded random adapter vector (``lora_B`` non-zero, so the
  adapter changes the output) is set in both models through their flat-vector views,
  both run on the same token ids, and the largest logit difference is measured
  (`logit_parity`). For a large checkpoint this uses a truncated copy of the model
  (its first few decoder layers, `truncated_copy`) and says so.

The sweep and the tests build the models they check with `yeto.testing.archs`.

Failures are `ParityError` with a ``stage`` that says whose problem it is (see
`STAGES`).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PREFIX = "base_model.model."
#: where a check can fail, in order; the sweep reports the stage with the reason
STAGES = {
    "tiny": "transformers cannot build a tiny random model of this architecture",
    "mlx-import": "mlx-lm's model module does not import",
    "torch-build": "transformers cannot load the model",
    "torch-targets": "LoRA target selection on the torch model",
    "mlx-load": "mlx-lm cannot build the model from the config (config translation)",
    "mlx-targets": "LoRA target selection on the MLX model",
    "names": "canonical names, shapes or order differ",
    "forward": "a forward pass failed",
    "logits": "the logits differ",
}
#: relative bound the sweep and the tests hold logits to: max|dlogit| <= REL_TOL * max|logit|
REL_TOL = 1e-4


class ParityError(Exception):
    """A check that could not pass; ``stage`` is one of `STAGES`."""

    def __init__(self, stage: str, message: str):
        super().__init__(message)
        self.stage = stage

    def __str__(self) -> str:
        return f"{self.stage}: {self.args[0]}"


@dataclass
class Report:
    """The outcome of `check`."""

    n_tensors: int = 0
    rows: list[str] = field(default_factory=list)   # the names table
    first_mismatch: str | None = None              # None: names, shapes, order agree
    torch_fingerprint: str = ""
    mlx_fingerprint: str = ""
    max_dlogit: float | None = None                # None: no logits compared
    max_logit: float | None = None
    adapter_effect: float | None = None             # max |logit(adapter) - logit(base)| (torch)
    base_dlogit: float | None = None                # max |dlogit| before the adapter is set
    numeric_layers: int | None = None               # set when logits ran on a truncated copy
    notes: list[str] = field(default_factory=list)
    n_expert_tensors: int = 0                       # LoRA tensors of MoE experts (fused or not)
    expert_effect: float | None = None              # max |logit change| of the expert adapter alone
    expert_dlogit: float | None = None              # max |dlogit| with the expert adapter alone

    @property
    def names_ok(self) -> bool:
        return self.first_mismatch is None and self.torch_fingerprint == self.mlx_fingerprint

    @property
    def rel(self) -> float | None:
        if self.max_dlogit is None:
            return None
        return self.max_dlogit / max(self.max_logit or 0.0, 1e-30)

    def logits_ok(self, rel_tol: float = REL_TOL) -> bool:
        experts_ok = self.expert_dlogit is None or \
            self.expert_dlogit <= rel_tol * max(self.max_logit or 0.0, 1e-30)
        return self.rel is not None and self.rel <= rel_tol and experts_ok


_EXPERT_TENSOR = re.compile(r"\.experts\.")


def expert_tensors(layout) -> list[str]:
    """The layout's LoRA tensors on mixture-of-experts experts: fused expert weights
    (``mlp.experts.lora_A.weight``, ``mlp.experts.base_layer.lora_A.weight``) and
    per-expert linears (``experts.0.w1.lora_A.weight``)."""
    return [s.name for s in layout.specs if _EXPERT_TENSOR.search(s.name)]


# ---- layouts ----------------------------------------------------------------
def _shape(spec) -> str:
    return "-" if spec is None else "x".join(map(str, spec.shape))


def compare_layouts(t, m) -> tuple[list[str], str | None]:
    """Table rows (one per tensor) and the first mismatch (None when the two
    `yeto.layout.Layout`s are identical)."""
    rows, first = [], None
    width = max([len(s.name) - len(PREFIX) for s in [*t.specs, *m.specs]] + [10])
    rows.append(f"{'#':>4}  {'canonical name (base_model.model. ...)':<{width}}  "
                f"{'torch':>12}  {'mlx':>12}")
    for i in range(max(len(t.specs), len(m.specs))):
        a = t.specs[i] if i < len(t.specs) else None
        b = m.specs[i] if i < len(m.specs) else None
        ok = a is not None and b is not None and a == b
        name = (a or b).name
        if a is not None and b is not None and a.name != b.name:
            name = f"{a.name} | mlx: {b.name[len(PREFIX):]}"
        rows.append(f"{i:>4}  {name[len(PREFIX):]:<{width}}  {_shape(a):>12}  {_shape(b):>12}"
                    f"{'' if ok else '  <-- differs'}")
        if not ok and first is None:
            if a is None or b is None:
                side, extra = ("torch", a) if b is None else ("mlx", b)
                first = (f"tensor #{i}: only {side} has {extra.name} {list(extra.shape)} "
                         f"(torch {len(t.specs)} tensors, mlx {len(m.specs)})")
            else:
                first = (f"tensor #{i}: torch has {a.name} {list(a.shape)}, "
                         f"mlx has {b.name} {list(b.shape)}")
    return rows, first


def _target_stage(e: Exception, side: str) -> str:
    """Attaching LoRA to a model that built: target selection and canonical names."""
    return f"{side}-targets"


def torch_lora(model_dir: str | Path, r: int, alpha: float, targets: str, *, meta: bool,
               seed: int = 0):
    """(peft model, TorchWeights) as the torch island builds them; on the meta device
    (shapes only) or with the real float32 weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from yeto.torch.model import attach_lora
    from yeto.torch.weights import TorchWeights

    try:
        if meta:
            config = AutoConfig.from_pretrained(str(model_dir))
            with torch.device("meta"):
                base = AutoModelForCausalLM.from_config(config)
        else:
            base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        base.eval()
    except Exception as e:  # noqa: BLE001 - reported with its stage
        raise ParityError("torch-build", f"{type(e).__name__}: {e}") from e
    try:
        model = attach_lora(base, r, alpha, targets, seed=seed)
    except Exception as e:  # noqa: BLE001
        raise ParityError(_target_stage(e, "torch"), f"{type(e).__name__}: {e}") from e
    return model, TorchWeights(model, "lora")


def mlx_lora(model_dir: str | Path, r: int, alpha: float, targets: str, *, lazy: bool,
             seed: int = 0):
    """(mlx model, LoRAWeights) as the MLX island builds them."""
    from yeto.mlx.hf_paths import hf_weight_names
    from yeto.mlx.learner import build_lora_model
    from yeto.mlx.load import load_model, read_config, resolve_model_dir
    from yeto.mlx.lora import LoRAWeights, attach_lora

    model_dir = resolve_model_dir(model_dir)
    config = read_config(model_dir)
    _import_mlx_module(config)
    try:
        model, _ = load_model(model_dir, lazy=lazy)
    except Exception as e:  # noqa: BLE001 - reported with its stage
        raise ParityError("mlx-load", f"{type(e).__name__}: {e}") from e
    try:
        layers = attach_lora(model, config, r, alpha, targets, seed,
                             hf_weight_names=hf_weight_names(model_dir))
    except Exception as e:  # noqa: BLE001
        raise ParityError(_target_stage(e, "mlx"), f"{type(e).__name__}: {e}") from e
    del build_lora_model  # the same two steps as build_lora_model, with a stage each
    return model, LoRAWeights(layers)


def _import_mlx_module(config: dict) -> None:
    """mlx-lm's module for this model type, imported on its own so that a module
    that cannot import (some call sys.exit) is told apart from a config problem."""
    from yeto.mlx.config import mlx_model_module

    try:
        mlx_model_module(config)
    except BaseException as e:  # noqa: BLE001 - SystemExit included (mlx-lm's olmo)
        if isinstance(e, KeyboardInterrupt):
            raise
        raise ParityError("mlx-import", f"{type(e).__name__}: {e}") from None


def names(model_dir: str | Path, r: int = 16, alpha: float = 32, targets: str = "auto",
          mlx_r: int | None = None, mlx_targets: str | None = None) -> Report:
    """Canonical names, shapes and order of both islands' trainable tensors, from
    shapes only (meta-device torch model, lazily loaded MLX model)."""
    from yeto.mlx.load import resolve_model_dir

    model_dir = resolve_model_dir(model_dir)
    _, tw = torch_lora(model_dir, r, alpha, targets, meta=True)
    _, mw = mlx_lora(model_dir, mlx_r or r, alpha, mlx_targets or targets, lazy=True)
    return _names_report(tw.layout, mw.layout)


def _names_report(t, m) -> Report:
    rows, first = compare_layouts(t, m)
    return Report(n_tensors=len(t.specs), rows=rows, first_mismatch=first,
                  torch_fingerprint=t.fingerprint, mlx_fingerprint=m.fingerprint,
                  n_expert_tensors=len(expert_tensors(t)))


# ---- logits -----------------------------------------------------------------
def adapter_vector(layout, seed: int = 0) -> np.ndarray:
    """A seeded random LoRA vector in `layout` order that makes the adapter matter:
    lora_A ~ N(0, 1/in), lora_B ~ N(0, 0.25/r), so B·A·x is about half of x."""
    rng = np.random.default_rng(seed)
    parts = []
    for spec in layout.specs:
        if spec.name.endswith("lora_A.weight"):
            std = 1.0 / np.sqrt(spec.shape[-1])
        elif spec.name.endswith("lora_B.weight"):
            std = 0.5 / np.sqrt(spec.shape[-1])
        else:
            std = 0.02
        parts.append(rng.standard_normal(int(np.prod(spec.shape))) * std)
    return np.concatenate(parts).astype(np.float32)


def token_ids(vocab_size: int, seed: int = 0, batch: int = 2, length: int = 16) -> np.ndarray:
    rng = np.random.default_rng(seed + 1)
    return rng.integers(0, vocab_size, size=(batch, length), dtype=np.int64)


def _torch_logits(model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids))
    return out.logits.float().numpy()


def _mlx_logits(model, ids: np.ndarray) -> np.ndarray:
    import mlx.core as mx

    out = model(mx.array(ids.astype(np.int32)))
    out = getattr(out, "logits", out)
    return np.array(out.astype(mx.float32))


def logit_parity(model_dir: str | Path, r: int = 16, alpha: float = 32, targets: str = "auto",
                 seed: int = 0, report: Report | None = None) -> Report:
    """Set the same seeded adapter in both islands' models of ``model_dir``, run both
    on the same token ids, fill max |dlogit| and max |logit| into the report (a new
    one, with the names table of these two models, unless one is given)."""
    tmodel, tw = torch_lora(model_dir, r, alpha, targets, meta=False, seed=seed)
    mmodel, mw = mlx_lora(model_dir, r, alpha, targets, lazy=False, seed=seed)
    if report is None:
        report = _names_report(tw.layout, mw.layout)
    elif tw.layout.fingerprint != mw.layout.fingerprint:
        _, first = compare_layouts(tw.layout, mw.layout)
        raise ParityError("names", f"on the truncated copy: {first}")
    if not report.names_ok:
        return report
    vocab = tmodel.get_input_embeddings().num_embeddings
    ids = token_ids(vocab, seed)
    try:
        base = _torch_logits(tmodel, ids)
        mlx_base = _mlx_logits(mmodel, ids)
        flat = adapter_vector(tw.layout, seed)
        tw.set(flat)
        mw.set(flat)
        want = _torch_logits(tmodel, ids)
        got = _mlx_logits(mmodel, ids)
    except Exception as e:  # noqa: BLE001 - reported with its stage
        if "LoRALinear" in str(e):  # the model reads a chosen layer's weight, not calls it
            raise ParityError("mlx-targets", f"mlx-lm uses an adapted layer's weight directly "
                              f"instead of calling the layer: {type(e).__name__}: {e}") from e
        raise ParityError("forward", f"{type(e).__name__}: {e}") from e
    if got.shape != want.shape:
        raise ParityError("logits", f"torch logits {want.shape}, mlx logits {got.shape}")
    report.max_dlogit = float(np.abs(got - want).max())
    report.max_logit = float(np.abs(want).max())
    report.adapter_effect = float(np.abs(want - base).max())
    if mlx_base.shape == base.shape:
        report.base_dlogit = float(np.abs(mlx_base - base).max())
        rel_base = report.base_dlogit / max(report.max_logit, 1e-30)
        if report.rel > REL_TOL and rel_base <= REL_TOL:
            culprit = _culprit(tmodel, mmodel, tw, mw, flat, ids)
            if culprit:
                report.notes.append(culprit)
    if report.n_expert_tensors:
        _expert_parity(report, tmodel, mmodel, tw, mw, flat, ids, base)
    if not np.isfinite(report.max_dlogit):
        report.max_dlogit = float("inf")
    return report


def _expert_parity(report: Report, tmodel, mmodel, tw, mw, flat: np.ndarray, ids: np.ndarray,
                   base: np.ndarray) -> None:
    """The expert adapter alone (every other LoRA tensor zero) in both models: how
    far it moves the torch logits, and how far the two backends' logits then differ
    (an expert LoRA the MLX island applied differently shows here even when the
    attention adapter dominates the full comparison)."""
    part = np.zeros_like(flat)
    for name in expert_tensors(tw.layout):
        lo, hi = tw.layout.offsets[name]
        part[lo:hi] = flat[lo:hi]
    try:
        tw.set(part)
        mw.set(part)
        want, got = _torch_logits(tmodel, ids), _mlx_logits(mmodel, ids)
    finally:
        tw.set(flat)
        mw.set(flat)
    report.expert_effect = float(np.abs(want - base).max())
    report.expert_dlogit = float(np.abs(got - want).max())


def _culprit(tmodel, mmodel, tw, mw, flat: np.ndarray, ids: np.ndarray,
             limit: int = 64) -> str | None:
    """The first adapted module whose adapter alone moves the two backends' logits
    apart (the base models agree), as a note; None when none does on its own."""
    modules: dict[str, list] = {}
    for spec in tw.layout.specs:
        modules.setdefault(spec.name.rsplit(".lora_", 1)[0], []).append(spec.name)
    try:
        for module, names in list(modules.items())[:limit]:
            part = np.zeros_like(flat)
            for name in names:
                lo, hi = tw.layout.offsets[name]
                part[lo:hi] = flat[lo:hi]
            tw.set(part)
            mw.set(part)
            want, got = _torch_logits(tmodel, ids), _mlx_logits(mmodel, ids)
            if np.abs(got - want).max() > REL_TOL * max(np.abs(want).max(), 1e-30):
                return (f"the adapter on {module[len(PREFIX):]} alone changes the torch and "
                        "MLX logits differently (the base models agree): the two backends "
                        "do not apply this layer the same way")
        return None
    finally:
        tw.set(flat)
        mw.set(flat)


# ---- truncated copies -------------------------------------------------------
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|block)\.(\d+)\.")


def checkpoint_bytes(model_dir: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(model_dir).glob("model*.safetensors"))


def layer_count(config: dict) -> int | None:
    """The number of decoder layers a config.json dict says (its text model's)."""
    sub = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return next((sub[k] for k in LAYER_COUNTS if isinstance(sub.get(k), int)), None)


def truncated_copy(model_dir: str | Path, n_layers: int, dest: str | Path) -> Path:
    """A copy of the model with only its first ``n_layers`` decoder layers (more where
    needed to keep one layer of every type a per-layer list names: a hybrid's first
    attention layer, its first MoE layer): the config says so (the layer count and
    every per-layer list cut to match) and the weights are the matching subset;
    vision and audio towers are kept whole. Returns ``dest`` (`layer_count` of its
    config.json says how many layers it kept)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    model_dir, dest = Path(model_dir), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    sub = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    old = next((sub[k] for k in LAYER_COUNTS if isinstance(sub.get(k), int)), None)
    if old is None:
        raise ParityError("torch-build", "cannot truncate: the config has no layer count")
    for v in sub.values():  # keep one layer of every kind (hybrids: attention, conv, MoE ...)
        if isinstance(v, list) and len(v) == old and all(isinstance(t, str) for t in v):
            n_layers = max([n_layers] + [v.index(t) + 1 for t in set(v)])
    n_layers = min(n_layers, old)
    for k in LAYER_COUNTS:
        if isinstance(sub.get(k), int):
            sub[k] = n_layers
    for k, v in list(sub.items()):
        if isinstance(v, list) and len(v) == old:
            sub[k] = v[:n_layers]
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for f in sorted(model_dir.glob("model*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                m = _LAYER.search(k)
                tower = any(t in k for t in ("vision", "visual", "audio"))  # their own depth
                if m is None or tower or int(m.group(1)) < n_layers:
                    tensors[k] = st.get_tensor(k)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copyfile(f, dest / f.name)
    return dest


def check(model_dir: str | Path, r: int = 16, alpha: float = 32, targets: str = "auto",
          mlx_r: int | None = None, mlx_targets: str | None = None, *, logits: bool = True,
          numeric_layers: int | None = None, max_full_bytes: int = 1 << 30,
          seed: int = 0) -> Report:
    """Names (always, from shapes) and then logits (unless ``logits=False``, or the
    islands are configured differently). Logits run on the whole model when its
    checkpoint is at most ``max_full_bytes``, else on a truncated copy of its first
    ``numeric_layers`` (default 2) layers; ``numeric_layers`` set forces truncation."""
    report = names(model_dir, r, alpha, targets, mlx_r, mlx_targets)
    differs = (mlx_r or r) != r or (mlx_targets or targets) != targets
    if not report.names_ok or not logits or differs:
        if differs and logits:
            report.notes.append("logits not compared: the two islands are configured "
                                "differently")
        return report
    from yeto.mlx.load import resolve_model_dir

    model_dir = resolve_model_dir(model_dir)
    if numeric_layers is None and checkpoint_bytes(model_dir) > max_full_bytes:
        numeric_layers = 2
    if numeric_layers is None:
        return logit_parity(model_dir, r, alpha, targets, seed, report)
    with tempfile.TemporaryDirectory(prefix="yeto-parity-") as tmp:
        truncated_copy(model_dir, numeric_layers, tmp)
        numeric_layers = layer_count(json.loads((Path(tmp) / "config.json").read_text()))
        report.numeric_layers = numeric_layers
        report.notes.append(f"logits compared on a truncated copy: the first {numeric_layers} "
                            "decoder layers")
        try:
            return logit_parity(tmp, r, alpha, targets, seed, report)
        except ParityError as e:
            raise ParityError(e.stage, f"{e.args[0]} (on a copy truncated to "
                              f"{numeric_layers} layers; --numeric-layers sets how many)") from e
