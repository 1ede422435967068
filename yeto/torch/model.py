"""The torch island's model: load a Hugging Face causal LM, attach peft LoRA on the
shared target selection, canonical tensor names, and the files its outputs carry."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from yeto import frozen
from yeto.data.models import resolve_model
from yeto.data.provenance import ModelSource
from yeto.interop.adapters import PEFT_CONFIG, PEFT_WEIGHTS, peft_adapter_config
from yeto.targets import (
    TargetError,
    expert_lora_module,
    is_fused_expert,
    select_experts,
    select_targets,
)


def load_base(model: str | ModelSource, dtype=torch.float32, *, revision: str | None = None,
              trust_remote_code: bool = False):
    """Load model + tokenizer from a local dir or a hub id, pinned and checked first
    (`yeto.data.models.resolve_model`: safetensors only, no repo code unless trusted)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = model if isinstance(model, ModelSource) else resolve_model(
        model, revision=revision, trust_remote_code=trust_remote_code)
    trust = src.trust_remote_code
    tok = AutoTokenizer.from_pretrained(str(src.path), trust_remote_code=trust)
    lm = AutoModelForCausalLM.from_pretrained(str(src.path), dtype=dtype, use_safetensors=True,
                                              trust_remote_code=trust)
    return lm, tok


def _conv1d_type():
    """transformers' ``Conv1D`` (gpt2-family linears, weight stored (in, out))."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is part of the torch extra
        return ()
    return Conv1D


def linear_paths(model: torch.nn.Module) -> list[str]:
    """Module paths of the layers LoRA can wrap: ``nn.Linear`` and transformers'
    ``Conv1D`` (the same function as a linear whose weight is transposed)."""
    kinds = (torch.nn.Linear, _conv1d_type())
    return [n for n, m in model.named_modules() if isinstance(m, kinds)]


def is_conv1d(module: torch.nn.Module) -> bool:
    conv1d = _conv1d_type()
    return bool(conv1d) and isinstance(module, conv1d)


@contextlib.contextmanager
def _targets_as_given():
    """peft with transformers 5 rewrites ``target_modules`` of many mixture-of-experts
    model types (qwen2_moe-like, mixtral-like) from transformers-4 names: any target
    ending in ``gate_proj``/``up_proj``/``down_proj``/``gate`` (``w1``/``w2``/``w3``)
    becomes a target *parameter* of the fused experts, so a dense layer's, a shared
    expert's or an attention gate's ``gate_proj`` would adapt the experts instead,
    or fail ("Cannot convert PEFT target(s) gate_proj without also targeting
    up_proj"). yeto's targets are always module paths of the loaded model, so that
    rewrite is switched off while peft attaches them."""
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:  # peft without it, or transformers < 5: nothing is rewritten
        yield
        return
    original = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original


def expert_param_paths(model: torch.nn.Module) -> list[str]:
    """Parameter paths of the fused expert weights (`yeto.targets.is_fused_expert`:
    transformers 5's ``mlp.experts.gate_up_proj`` / ``down_proj``)."""
    return [f"{m}.{n}" for m, module in model.named_modules()
            for n, p in module.named_parameters(recurse=False)
            if is_fused_expert(f"{m}.{n}", p.ndim)]


def attach_lora(model, r: int, alpha: float, targets: str, seed: int,
                freeze_a: bool = False):
    """peft LoRA on the shared target selection (`yeto.targets.select_targets`,
    `yeto.targets.select_experts`). Conv1D targets get peft's ``fan_in_fan_out=True``:
    lora_A stays (r, in) and lora_B (out, r), and the forward adds ``scale·B·A·x``
    as for a linear (only a merge transposes the delta into Conv1D's (in, out)
    weight). Fused expert weights get peft's ``target_parameters`` (one
    ``ParamWrapper`` each: lora_A (r·E, in), lora_B (out, r·E), per expert e the
    weight W_e + scale·B_e·A_e). With `freeze_a`, every lora_A is drawn from `seed`
    by `yeto.frozen` (the same bits on every island and backend) and never
    trained, so only lora_B is synced and the merge is exact."""
    from peft import LoraConfig, get_peft_model

    config = model.config.to_dict()
    linears, fused = linear_paths(model), expert_param_paths(model)
    chosen = select_targets(linears, targets, config, experts=fused)
    params = select_experts(fused, targets, config, linears)
    modules = dict(model.named_modules())
    fan_in_fan_out = any(is_conv1d(modules[p]) for p in chosen)
    if fan_in_fan_out and params:  # pragma: no cover - no transformers model has both
        raise TargetError("peft cannot adapt fused expert weights in a model with Conv1D "
                          "linears (fan_in_fan_out); leave the experts out, e.g. "
                          "--lora-targets attention")
    torch.manual_seed(seed)  # same init on every island with the same seed
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=chosen or None,
                     target_parameters=params or None, lora_dropout=0.0, bias="none",
                     task_type="CAUSAL_LM", fan_in_fan_out=fan_in_fan_out)
    with _targets_as_given():
        model = get_peft_model(model, cfg)
    _check_expert_names(model, params)
    if freeze_a:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_A." in name:
                    key = canonical_name(name, "lora")
                    p.copy_(torch.from_numpy(frozen.frozen_lora_a(key, tuple(p.shape), seed)))
                    p.requires_grad_(False)
    return model


def _check_expert_names(model, params: list[str]) -> None:
    """peft names each fused weight's LoRA by how it nested the wrappers; the MLX
    island derives the same names from `yeto.targets.expert_lora_module`."""
    got = {canonical_name(n, "lora").removeprefix("base_model.model.").removesuffix(
        ".lora_A.weight") for n, _ in model.named_parameters()
        if n.endswith("lora_A.default.weight")}
    want = {expert_lora_module(p, params) for p in params}
    if not want <= got:
        raise TargetError(f"peft named the fused expert LoRA {sorted(got)}, not "
                          f"{sorted(want - got)} (yeto.targets.expert_lora_module): this "
                          "model registers its expert weights in another order; leave the "
                          "experts out, e.g. --lora-targets attention")


def canonical_name(param_name: str, tuning: str) -> str:
    """peft's saved key for LoRA (adapter name dropped); the HF name in full mode."""
    if tuning == "lora":
        return param_name.replace(".default.", ".")
    return param_name


# ---- outputs ----------------------------------------------------------------
def save_output(model, out: Path, tuning: str, tokenizer=None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if tuning == "full" and tokenizer is not None:
        tokenizer.save_pretrained(out)


def export_files(model, tuning: str, frozen_seed: int | None = None) -> tuple[str, dict]:
    """The weights file name and text files the syncer writes beside its final
    weights, so its output loads exactly like an island's."""
    if tuning == "full":
        return "model.safetensors", {"config.json": model.config.to_json_string()}
    cfg = model.peft_config["default"]
    files = {PEFT_CONFIG: peft_adapter_config(cfg.base_model_name_or_path, cfg.r, cfg.lora_alpha,
                                              cfg.target_modules or [], cfg.lora_dropout,
                                              target_parameters=cfg.target_parameters)}
    if frozen_seed is not None:
        shapes = {canonical_name(n, "lora"): tuple(p.shape) for n, p in model.named_parameters()
                  if ".lora_A." in n}
        files[frozen.EXPORT_FILE] = frozen.describe(frozen_seed, shapes)
    return PEFT_WEIGHTS, files
