"""`yeto export` and `yeto convert`: a run's adapter for peft or mlx-lm, exactly.

    yeto export --state-dir runs/demo/syncer --out runs/demo/mlx --format mlx
    yeto convert runs/demo/adapter runs/demo/mlx --to mlx [--verify]
    yeto convert runs/demo/mlx runs/demo/peft --to peft --base-model runs/demo/model

`export` takes the syncer's final adapter (``<state-dir>/final/``), or, for a run
that has not finished, the last merged weights in ``<state-dir>/state.safetensors``
(with the adapter config the islands sent). `convert` converts an adapter dir
either way. The conversion itself is `yeto.interop.adapters` (lora_a = Aᵀ, lora_b = Bᵀ,
scale = lora_alpha / r; numbers copied bit for bit); mlx-lm adapts the *last*
``num_layers`` blocks with one list of module keys, and the written config says
exactly which. What mlx-lm cannot express exactly (rsLoRA, DoRA, per-module
rank/alpha patterns, biases, saved modules, adapted blocks that are not the last
N) is refused with the reason. ``--verify`` loads both sides with the real loaders
(``peft.PeftModel.from_pretrained``, ``mlx_lm.load(..., adapter_path=...)``) and
compares their logits on a fixed batch.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from yeto.frozen import run_adapter_tensors
from yeto.interop.adapters import (
    _MLX_KEY,
    _PEFT_KEY,
    MLX_CONFIG,
    MLX_WEIGHTS,
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    mlx_to_peft,
    peft_to_mlx,
    save_peft_adapter,
    scale_problem,
    values_problem,
)
from yeto.io import atomic_save, atomic_write

FORMATS = ("peft", "mlx")


class ExportError(RuntimeError):
    """An export or conversion that cannot be done (the message says why)."""


# ---- what a dir holds -----------------------------------------------------------------
def adapter_format(path: Path) -> str:
    """"peft" or "mlx" for an adapter dir, else ExportError."""
    path = Path(path)
    if (path / PEFT_WEIGHTS).is_file() and (path / PEFT_CONFIG).is_file():
        return "peft"
    if (path / MLX_WEIGHTS).is_file() and (path / MLX_CONFIG).is_file():
        return "mlx"
    if (path / "model.safetensors").is_file():
        raise ExportError(f"{path} holds full model weights (model.safetensors), not a LoRA "
                          "adapter: it already loads with transformers' from_pretrained (copy "
                          "the tokenizer files from the base model beside it)")
    raise ExportError(f"{path} is not an adapter dir: expected {PEFT_WEIGHTS} + {PEFT_CONFIG} "
                      f"(peft) or {MLX_WEIGHTS} + {MLX_CONFIG} (mlx-lm)")


# ---- what an adapter holds ------------------------------------------------------------
_DAMAGED = ("; a damaged or partial copy? Copy the adapter again, or export it again from its "
            "run: yeto export --state-dir runs/demo/syncer --out DIR")


def check_adapter(path: Path, fix: str = _DAMAGED) -> str:
    """The format ("peft" | "mlx") of an adapter dir after checking what it holds: the
    config is a JSON object, the weights parse as safetensors (the library's own
    reader), every value is finite and within `MAX_FACTOR_ABS`, the LoRA scale within
    `MAX_LORA_SCALE` (both in `yeto.interop.adapters`), and the LoRA factors come in
    pairs of one rank (peft: the config's r and target_modules; mlx-lm:
    lora_parameters' rank and keys).
    `ExportError` naming the file, the problem and ``fix`` (what to do) otherwise."""
    path = Path(path)
    kind = adapter_format(path)
    weights = path / (PEFT_WEIGHTS if kind == "peft" else MLX_WEIGHTS)
    cfg = _read_config(path / PEFT_CONFIG, fix)
    shapes = _sane_tensor_shapes(weights, fix)
    problem = scale_problem(cfg)
    if problem:
        raise ExportError(f"{path / PEFT_CONFIG}: {problem}{fix}")
    problem = (_peft_problem if kind == "peft" else _mlx_problem)(shapes, cfg)
    if problem:
        raise ExportError(f"{weights}: {problem}{fix}")
    return kind


def _read_config(path: Path, fix: str) -> dict:
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"{path} is not a readable JSON file ({e}){fix}") from None
    if not isinstance(cfg, dict):
        raise ExportError(f"{path} holds a JSON {type(cfg).__name__}, not an adapter config "
                          f"object{fix}")
    return cfg


def _sane_tensor_shapes(path: Path, fix: str) -> dict[str, tuple[int, ...]]:
    """{name: shape} of a safetensors file whose every value is finite and within the
    bound on LoRA factors (`yeto.interop.adapters.values_problem`)."""
    from safetensors import SafetensorError, safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    try:
        with safe_open(str(path), framework="numpy") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                shapes[name] = tuple(st.get_slice(name).get_shape())
                problem = values_problem(name, _values(st, path, name))
                if problem:
                    raise ExportError(f"{path}: {problem}{fix}")
    except (SafetensorError, OSError) as e:
        raise ExportError(f"{path} is not a readable safetensors file ({e}){fix}") from None
    if not shapes:
        raise ExportError(f"{path} holds no tensors{fix}")
    return shapes


def _values(st, path: Path, name: str):
    """Tensor `name` as a numpy array; bfloat16 and fp8, which numpy cannot hold, as
    float32 through torch when it is installed (else an empty array: unchecked)."""
    import numpy as np

    try:
        return st.get_tensor(name)
    except TypeError:  # a dtype numpy lacks
        try:
            import torch  # noqa: F401 - safetensors' "pt" framework needs it
            from safetensors import safe_open
        except ImportError:
            return np.zeros(0, np.float32)
        with safe_open(str(path), framework="pt") as pt:
            return pt.get_tensor(name).float().numpy()


def _factors(shapes: dict, key: re.Pattern) -> dict[str, dict[str, tuple]]:
    """{module: {"A" | "B" (peft) or "a" | "b" (mlx-lm): shape}} of the LoRA factors."""
    parts: dict[str, dict[str, tuple]] = {}
    for name, shape in shapes.items():
        m = key.match(name)
        if m is not None:
            parts.setdefault(m["module"], {})[m["which"]] = shape
    return parts


def _pairs_problem(parts: dict, a: str, b: str, ranks) -> str | None:
    """What is wrong with the LoRA factor pairs (None when nothing): every module has
    both factors, of one rank (`ranks(shape_a, shape_b)`: the rank each one says)."""
    if not parts:
        return "holds no LoRA factors"
    for module, p in sorted(parts.items()):
        if set(p) != {a, b}:
            have = next(iter(p))
            return f"{module} has lora_{have} but no lora_{a if have == b else b}"
        if len(p[a]) < 2 or len(p[b]) < 2 or len(set(ranks(p[a], p[b]))) != 1:
            return (f"{module}: lora_{a} {list(p[a])} and lora_{b} {list(p[b])} do not share "
                    "one rank")
    return None


def _peft_problem(shapes: dict, cfg: dict) -> str | None:
    parts = _factors(shapes, _PEFT_KEY)
    problem = _pairs_problem(parts, "A", "B", lambda sa, sb: (sa[0], sb[1]))
    if problem:
        return problem
    r, targets = cfg.get("r"), cfg.get("target_modules")
    for module, p in sorted(parts.items()):
        if isinstance(r, int) and not cfg.get("rank_pattern") and p["A"][0] != r:
            return f"{module} has rank {p['A'][0]} but adapter_config.json says r={r}"
        if not _targeted(module, targets):
            return (f"{module} has LoRA factors but is not among adapter_config.json's "
                    f"target_modules {targets!r}")
    return None


def _mlx_problem(shapes: dict, cfg: dict) -> str | None:
    parts = _factors(shapes, _MLX_KEY)
    problem = _pairs_problem(parts, "a", "b", lambda sa, sb: (sa[-1], sb[-2]))
    if problem:
        return problem
    lp = cfg.get("lora_parameters") if isinstance(cfg.get("lora_parameters"), dict) else {}
    rank, keys = lp.get("rank"), lp.get("keys")
    for module, p in sorted(parts.items()):
        if isinstance(rank, int) and p["a"][-1] != rank:
            return (f"{module} has rank {p['a'][-1]} but adapter_config.json says "
                    f"lora_parameters.rank={rank}")
        if isinstance(keys, list) and not _targeted(module, keys):
            return (f"{module} has LoRA factors but is not among adapter_config.json's "
                    f"lora_parameters.keys {keys!r}")
    return None


def _targeted(module: str, targets) -> bool:
    """Whether peft's target_modules (a list of name suffixes or one regex) or mlx-lm's
    keys name `module`; True when there is nothing cheap to compare with."""
    if isinstance(targets, str):
        return targets == "all-linear" or re.fullmatch(targets, module) is not None
    if isinstance(targets, list) and targets:
        return any(module == t or module.endswith("." + str(t)) for t in targets)
    return True


def base_model_of(adapter_dir: Path) -> str | None:
    """The base model an adapter dir names (peft's base_model_name_or_path, mlx-lm's
    model, or the peft config kept inside an mlx-lm config)."""
    cfg_path = Path(adapter_dir) / PEFT_CONFIG  # the same file name for both formats
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    for value in (cfg.get("base_model_name_or_path"), cfg.get("model"),
                  (cfg.get("peft_config") or {}).get("base_model_name_or_path")):
        if value:
            return str(value)
    return None


# ---- export -----------------------------------------------------------------------------
def export(state_dir: Path | list[Path], out: Path, fmt: str, base_model: str | None = None,
           allow_unfinished: bool = True, force: bool = False) -> tuple[Path, str]:
    """Write the run's adapter in ``fmt``; returns (out, a line saying what was exported).
    The adapter is checked first (`check_adapter`); ``out`` must be new or empty unless
    ``force``. A sharded run (`syncer.shards`) gives every shard's state dir: the
    adapter is assembled from their states, each fragment from its owner."""
    if isinstance(state_dir, list) and len(state_dir) > 1:
        dirs, out = [Path(d) for d in state_dir], Path(out)
        check_out_dir(out, force, "--out", inputs=tuple(dirs))
        with tempfile.TemporaryDirectory() as tmp:
            version = _adapter_from_shards(dirs, Path(tmp))
            what = (f"the merged weights of {len(dirs)} shards (versions {version}), "
                    "assembled fragment by fragment")
            return _write(Path(tmp), out, fmt, base_model), what
    if isinstance(state_dir, list):
        state_dir = state_dir[0]
    state_dir, out = Path(state_dir), Path(out)
    final = state_dir / "final"
    check_out_dir(out, force, "--out", inputs=(state_dir, final))
    if final.is_dir() and any(final.iterdir()):
        check_adapter(final, _final_fix(state_dir))
        what = f"the final adapter of {state_dir}"
        return _write(final, out, fmt, base_model), what
    if not (state_dir / "state.safetensors").is_file():
        raise ExportError(f"{state_dir} holds neither final/ nor state.safetensors: pass the "
                          "syncer's --state-dir (e.g. runs/demo/syncer)")
    if not allow_unfinished:
        raise ExportError(f"{state_dir} has no final/ (the run has not finished)")
    with tempfile.TemporaryDirectory() as tmp:
        version = _adapter_from_state(state_dir, Path(tmp))
        what = (f"the last merged weights of {state_dir} (version {version}; the run has not "
                "finished, so there is no final/ yet)")
        return _write(Path(tmp), out, fmt, base_model), what


def _final_fix(state_dir: Path) -> str:
    final = state_dir / "final"
    if not (state_dir / "state.safetensors").is_file():
        return f"; {final} is damaged and {state_dir} holds no state.safetensors to export instead"
    return (f"; the run's last merged weights are in {state_dir}/state.safetensors: move the "
            f"damaged final/ aside (mv {final} {final}.bad) and run yeto export again")


def check_out_dir(out: Path, force: bool, name: str, inputs: tuple = ()) -> None:
    """Refuse to write into ``out`` (the flag or argument `name`) when it is a file, one
    of the `inputs`, or a non-empty dir without ``force``."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"{name} {out} is a file, not a directory: choose another dir")
    if any(out.resolve() == Path(p).resolve() for p in inputs):
        raise ExportError(f"{name} {out} is the run's own dir: write the adapter somewhere else")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"{name} {out} already exists and is not empty: pass --force to write "
                          "the adapter over what it holds, or choose a new dir")


def _drop_other_format(out: Path, fmt: str) -> None:
    """Under --force: remove the other format's weights from ``out``, which would
    otherwise sit beside the new adapter config and make the dir ambiguous."""
    (out / (PEFT_WEIGHTS if fmt == "mlx" else MLX_WEIGHTS)).unlink(missing_ok=True)


def _adapter_from_shards(dirs: list[Path], out: Path) -> str:
    """The adapter of a sharded run from all its shards' states; returns their versions."""
    from syncer.shards import owners
    from syncer.state import StateError, load
    from yeto.layout import Layout, TensorSpec

    try:
        states = [load(d) for d in dirs]
    except StateError as e:
        raise ExportError(str(e)) from None
    metas = [s[3] for s in states]
    count = len(dirs)
    where = {tuple(m.get("shard", [0, 1])): (d, s) for d, s, m in zip(dirs, states, metas)}
    missing = [i for i in range(count) if (i, count) not in where]
    if missing or len({m["fingerprint"] for m in metas}) != 1:
        got = ", ".join(f"{d}: shard {'/'.join(map(str, m.get('shard', [0, 1])))}, layout "
                        f"{m['fingerprint'][:12]}" for d, m in zip(dirs, metas))
        raise ExportError(f"--state-dir: {count} dirs must be shards 0/{count} .. "
                          f"{count - 1}/{count} of one run (one layout); got {got}")
    meta = metas[0]
    layout = Layout([TensorSpec(n, tuple(s), d) for n, s, d in meta["layout"]],
                    len(meta["fragment_versions"]))
    theta = where[(0, count)][1][0].copy()
    for f, owner in enumerate(owners([frag.numel for frag in layout.fragments], count)):
        frag = layout.fragments[f]
        theta[frag.start:frag.stop] = where[(owner, count)][1][0][frag.start:frag.stop]
    _adapter_from(theta, meta, f"the shards' states ({', '.join(map(str, dirs))})", out)
    return "/".join(str(m["version"]) for m in metas)


def _adapter_from_state(state_dir: Path, out: Path) -> int:
    from syncer.state import StateError, load

    try:
        theta, _, _, meta = load(state_dir)
    except StateError as e:
        raise ExportError(str(e)) from None
    _adapter_from(theta, meta, f"{state_dir}/state.safetensors", out)
    return int(meta.get("version", 0))


def _adapter_from(theta, meta: dict, source: str, out: Path) -> None:
    """A peft adapter from a run's Θ and its state's metadata."""
    import numpy as np

    from yeto.layout import Layout, TensorSpec

    if meta.get("weights_file") != PEFT_WEIGHTS or PEFT_CONFIG not in meta.get("export_files",
                                                                                {}):
        raise ExportError(f"{source}: the run's weights are {meta.get('weights_file')!r} "
                          "without a peft adapter config: only LoRA runs export as adapters")
    bad = int(theta.size - np.count_nonzero(np.isfinite(theta)))
    if bad:
        raise ExportError(f"{source}: the run's merged weights hold {bad} "
                          "NaN or infinite values: the run diverged or the file is damaged")
    layout = Layout([TensorSpec(n, tuple(s), d) for n, s, d in meta["layout"]])
    # the same tensors the syncer's final/ gets (frozen-A runs: lora_A rebuilt from the seed)
    tensors = run_adapter_tensors(layout.unflatten(theta), meta["export_files"])
    config = meta["export_files"][PEFT_CONFIG]
    problem = next(filter(None, (values_problem(k, v) for k, v in tensors.items())), None)
    try:
        problem = problem or scale_problem(json.loads(config))
    except (json.JSONDecodeError, AttributeError, TypeError):
        problem = "the adapter config the islands sent is not a JSON object"
    if problem:
        raise ExportError(f"{source}: {problem}: the run diverged or the "
                          "file is damaged")
    save_peft_adapter(out, tensors, config)


def _write(src: Path, out: Path, fmt: str, base_model: str | None) -> Path:
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}: choose peft or mlx")
    kind = adapter_format(src)
    if kind == "mlx":
        raise ExportError(f"{src} is an mlx-lm adapter; `yeto convert` converts it")
    _drop_other_format(out, fmt)
    if fmt == "mlx":
        return peft_to_mlx(src, out, base_model=base_model)
    out.mkdir(parents=True, exist_ok=True)
    atomic_save(out / PEFT_WEIGHTS, lambda tmp: shutil.copyfile(src / PEFT_WEIGHTS, tmp))
    cfg = json.loads((src / PEFT_CONFIG).read_text())
    if base_model is not None:
        cfg["base_model_name_or_path"] = str(base_model)
    atomic_write(out / PEFT_CONFIG, json.dumps(cfg, indent=2, sort_keys=True))
    return out


# ---- convert ----------------------------------------------------------------------------
def convert(src: Path, dest: Path, to: str, base_model: str | None = None,
            force: bool = False) -> Path:
    """Convert the adapter dir ``src`` to ``to`` in ``dest``, after checking it
    (`check_adapter`); ``dest`` must be new or empty unless ``force``."""
    src, dest = Path(src), Path(dest)
    if to not in FORMATS:
        raise ExportError(f"--to {to!r}: choose peft or mlx")
    kind = adapter_format(src)
    if src.resolve() == dest.resolve():
        raise ExportError("SRC and DEST are the same dir: write the conversion somewhere else")
    if kind == to:
        raise ExportError(f"{src} is already a {to} adapter (nothing to convert)")
    base = base_model or (base_model_of(src) if to == "peft" else None)
    if to == "peft" and not base:
        raise ExportError(f"{src} does not name its base model: pass --base-model PATH (the "
                          "Hugging Face model dir the adapter was trained on)")
    check_out_dir(dest, force, "DEST")
    check_adapter(src)
    _drop_other_format(dest, to)
    if to == "mlx":
        return peft_to_mlx(src, dest, base_model=base_model)
    return mlx_to_peft(src, dest, base_model=base)


VERIFY_TOL = 1e-4  # relative: float32 noise over a few dozen layers stays far below it

# ---- verify -----------------------------------------------------------------------------
def load_with_mlx_lm_adapter(base_model: str | Path, mlx_dir: str | Path, plain: bool = True):
    """The base model with the mlx-lm adapter in float32. `plain`: exactly what a user's
    ``mlx_lm.load(base_model, adapter_path=mlx_dir)`` computes; else through yeto's
    config translation (`yeto.mlx.load.load_model`, what the MLX island loads)."""
    import mlx.core as mx

    if plain:
        import mlx_lm

        model, _ = mlx_lm.load(str(base_model), adapter_path=str(mlx_dir))
        model.set_dtype(mx.float32)
    else:
        from mlx_lm.tuner.utils import load_adapters

        from yeto.mlx.load import load_model

        model = load_adapters(load_model(base_model)[0], str(mlx_dir))
    model.eval()
    return model


@dataclass(frozen=True)
class Verdict:
    """What `verify` measured: max |Δlogit| between peft and plain mlx-lm, the largest
    |logit| (the tolerance is relative to it), and, when plain mlx-lm could not load the
    base or disagreed, the same through yeto's config translation and why."""

    diff: float
    scale: float
    shim_diff: float | None = None
    note: str = ""

    def ok(self, rel_tol: float) -> bool:
        return self.diff <= rel_tol * max(1.0, self.scale)


def verify(peft_dir: Path, mlx_dir: Path, base_model: str, seq_len: int = 24,
           batch: int = 2, seed: int = 0, rel_tol: float = 1e-4) -> Verdict:
    """Compare the logits of the base model with the peft adapter
    (``peft.PeftModel.from_pretrained``) and with the mlx-lm adapter as plain
    ``mlx_lm.load(base, adapter_path=...)`` loads it, both in float32, on a fixed
    batch. A `.gguf` base is read into its model dir first (`yeto.gguf`)."""
    import mlx.core as mx
    import numpy as np
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from yeto import gguf

    base = gguf.model_dir(base_model) if gguf.is_gguf(base_model) else Path(base_model)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    vocab = model.config.vocab_size
    ids = np.random.default_rng(seed).integers(3, min(vocab, 30000), (batch, seq_len))
    peft_model = PeftModel.from_pretrained(model, str(peft_dir)).eval()
    with torch.no_grad():
        want = peft_model(input_ids=torch.from_numpy(ids)).logits.float().numpy()
    scale = float(np.abs(want).max())

    def diff(plain: bool) -> float:
        got = load_with_mlx_lm_adapter(base, mlx_dir, plain)(mx.array(ids))
        return float(np.abs(np.asarray(got.astype(mx.float32)) - want).max())

    try:
        plain = diff(True)
    except Exception as e:  # noqa: BLE001 - any failure of mlx-lm's own loader is the finding
        return Verdict(float("inf"), scale, diff(False),
                       f"plain mlx_lm.load cannot load {base} ({type(e).__name__}: {e})")
    verdict = Verdict(plain, scale)
    if not verdict.ok(rel_tol):
        verdict = Verdict(plain, scale, diff(False), _config_note(base))
    return verdict


def _config_note(base: Path) -> str:
    """Why plain mlx-lm may compute another function than transformers on `base`."""
    try:
        config = json.loads((base / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    theta = (config.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and "rope_theta" not in config:
        return (f"{base}/config.json has rope_theta {theta:g} only inside rope_parameters "
                "(as transformers 5 saves it); mlx-lm reads a top-level rope_theta and falls "
                f"back to its default: add \"rope_theta\": {theta:g} at the top level of that "
                "config.json")
    return ""


# ---- CLI ----------------------------------------------------------------------------------
def build_export_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="yeto export", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Write a run's adapter (the syncer's final/, or its last merged weights "
                    "when the run has not finished) as a peft or an mlx-lm adapter.",
        epilog="Examples:\n  yeto export --state-dir runs/demo/syncer --out runs/demo/mlx "
               "--format mlx\n  python -m mlx_lm generate --model runs/demo/model "
               "--adapter-path runs/demo/mlx --prompt ...")
    p.add_argument("--state-dir", type=Path, required=True, action="append",
                   help="the syncer's --state-dir; a sharded run: every shard's, each with "
                        "its own --state-dir (the adapter is assembled from them)")
    p.add_argument("--out", type=Path, required=True, help="the adapter dir to write")
    p.add_argument("--format", choices=FORMATS, default="peft",
                   help="peft (PeftModel.from_pretrained) or mlx (mlx_lm.load adapter_path)")
    p.add_argument("--base-model", default=None,
                   help="the local base model dir (default: the one the adapter names); mlx-lm "
                        "needs its block count")
    p.add_argument("--force", action="store_true",
                   help="write into --out even when it is not empty (its adapter is replaced)")
    p.add_argument("--final-only", action="store_true",
                   help="refuse a run that has not finished instead of exporting its last "
                        "merged weights")
    p.add_argument("--verify", action="store_true",
                   help="with --format mlx: load the adapter with plain mlx_lm.load and the "
                        "peft one with peft, and compare logits (needs torch, peft, mlx, "
                        "mlx-lm)")
    p.add_argument("--verify-tol", type=float, default=VERIFY_TOL,
                   help="largest accepted max |Δlogit| for --verify, relative to the "
                        "largest |logit| (at least 1)")
    return p


def build_convert_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="yeto convert", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Convert a LoRA adapter between peft's layout and mlx-lm's, exactly "
                    "(refusing what cannot be converted exactly).",
        epilog="Examples:\n  yeto convert runs/demo/adapter runs/demo/mlx --to mlx\n"
               "  yeto convert adapters/ peft-adapter/ --to peft --base-model runs/demo/model")
    p.add_argument("src", type=Path, help="an adapter dir (peft or mlx-lm; detected)")
    p.add_argument("dest", type=Path, help="the dir to write")
    p.add_argument("--to", choices=FORMATS, required=True, help="the format to write")
    p.add_argument("--force", action="store_true",
                   help="write into DEST even when it is not empty (its adapter is replaced)")
    p.add_argument("--base-model", default=None,
                   help="the local base model dir (default: the one the adapter names)")
    p.add_argument("--verify", action="store_true",
                   help="load both adapters with the real loaders (peft, plain mlx_lm.load) "
                        "and compare logits")
    p.add_argument("--verify-tol", type=float, default=VERIFY_TOL,
                   help="largest accepted max |Δlogit| for --verify, relative to the "
                        "largest |logit| (at least 1)")
    return p


def _run_verify(peft_dir: Path, mlx_dir: Path, base: str | None, tol: float) -> int:
    if not base:
        print("error: --verify needs the base model: pass --base-model PATH", file=sys.stderr)
        return 2
    v = verify(peft_dir, mlx_dir, base, rel_tol=tol)
    ok = v.ok(tol)
    print(f"verify: max |logits(peft) - logits(mlx_lm.load)| = {v.diff:.3g} at max |logit| "
          f"{v.scale:.3g} ({'ok' if ok else 'FAILED'}, tolerance {tol:g} x max(1, |logit|))")
    if v.shim_diff is not None:
        print(f"  through yeto's config translation (what the MLX island loads): "
              f"{v.shim_diff:.3g}")
    if v.note:
        print(f"  {v.note}")
    return 0 if ok else 1


def main_export(argv=None) -> int:
    args = build_export_parser().parse_args(argv)
    try:
        out, what = export(args.state_dir, args.out, args.format, args.base_model,
                           allow_unfinished=not args.final_only, force=args.force)
    except (ExportError, ValueError, OSError) as e:  # ValueError: AdapterConversionError too
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {what} to {out} ({args.format})")
    if args.verify:
        if args.format != "mlx":
            print("error: --verify compares a peft and an mlx-lm adapter: use --format mlx",
                  file=sys.stderr)
            return 2
        final = args.state_dir[0] / "final"
        if len(args.state_dir) > 1 or not final.is_dir():
            print("error: --verify needs the run's final/ adapter", file=sys.stderr)
            return 2
        return _run_verify(final, out, args.base_model or base_model_of(final), args.verify_tol)
    return 0


def main_convert(argv=None) -> int:
    args = build_convert_parser().parse_args(argv)
    try:
        out = convert(args.src, args.dest, args.to, args.base_model, force=args.force)
    except (ExportError, ValueError, OSError) as e:  # ValueError: AdapterConversionError too
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"converted {args.src} to {out} ({args.to})")
    if args.verify:
        peft_dir, mlx_dir = (args.src, out) if args.to == "mlx" else (out, args.src)
        base = args.base_model or base_model_of(peft_dir)
        return _run_verify(peft_dir, mlx_dir, base, args.verify_tol)
    return 0
