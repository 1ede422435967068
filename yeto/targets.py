"""Which linears get LoRA: one rule for the torch and MLX islands.

Both backends hand this module the Hugging Face module paths of their linear
layers (the torch island its ``nn.Linear`` and transformers ``Conv1D`` modules;
the MLX island its ``nn.Linear`` modules, renamed to the Hugging Face paths they
were loaded from, see `yeto.mlx.lora`), and `select_targets` picks the same
ones from the paths and the model's config, so both islands adapt the same
modules and produce the same canonical (peft) names. No backend is imported here.

The rule is structural, not a list of module names per architecture:

- A **decoder block** is what the first integer segment of a path indexes
  (``model.layers.3.``, ``transformer.h.3.``, ``gpt_neox.layers.3.``); only
  linears inside the language model's blocks are ever chosen (never embeddings,
  ``lm_head``, or the vision/audio towers of a multimodal checkpoint).
- **attention** = the linears under a block submodule whose name says attention
  (``self_attn``, ``attn``, ``attention``, ``linear_attn``, ...), plus, for blocks
  whose mixer has another name (``mixer``, ``temporal_block``), the classic
  projection names (`ATTENTION_LEAVES`). Fused projections (``c_attn``,
  ``query_key_value``, ``qkv_proj``, ``Wqkv``) are found like any other.
- **all-linear** = every linear in the blocks (the MLP's ``c_fc``/``c_proj``,
  ``dense_h_to_4h``, ``fc1``/``fc2``, ``w1``/``w2``/``w3``, ``in_proj``/
  ``out_proj``, ...), and the experts: per-expert linears, or fused expert
  weights (below); their routers are not.
- **auto** = all-linear for dense models; attention for mixture-of-experts models
  (adapting every expert multiplies the adapter size; all-linear adapts them), or,
  for an MoE without attention projections, its linears that are not experts; with a log line.
- A **comma list** names modules as peft's ``target_modules`` does: an entry
  matches a path equal to it or ending in ``.<entry>`` (``q_proj``,
  ``self_attn.o_proj``); expert linears only when the entry names ``experts``.
- Never chosen: the linears LoRA cannot adapt on the torch island
  (`NOT_ADAPTABLE`: Mamba mixers' weights that peft refuses or transformers reads
  directly).

**Fused experts.** transformers 5 stores most mixture-of-experts experts as 3-D
weights of one module (``mlp.experts.gate_up_proj`` (E, 2I, H),
``mlp.experts.down_proj`` (E, H, I)), mlx-lm as ``SwitchLinear`` layers. Neither
is a linear layer, so they are chosen apart from the linears (`select_experts`,
on the *parameter* paths): ``all-linear`` and a list entry naming ``experts``
(``experts``, ``mlp.experts``, ``experts.down_proj``) adapt them, ``auto`` and
``attention`` do not. The torch island adapts them with peft's
``target_parameters`` (``ParamWrapper``: per expert e, W_e + (alpha/r)·B_e·A_e),
the MLX island with `yeto.mlx.experts`, both under the names peft saves
(`expert_lora_module`). The router beside the experts stays frozen.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

log = logging.getLogger("yeto.targets")

TARGET_MODES = ("auto", "attention", "all-linear")
FLAG = "--lora-targets"
#: projection names that mean attention even outside a submodule named "attn"
ATTENTION_LEAVES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj",
                              "query_key_value", "c_attn", "Wqkv"})
_BLOCK = re.compile(r"(?:^|\.)\d+\.")
#: the towers of multimodal checkpoints (yeto fine-tunes the language model; mlx-lm
#: drops the towers when it loads one)
_TOWER = re.compile(r"(?:^|\.)\w*(?:vision|visual|image|audio|speech|multi_modal|mm_proj)\w*\.",
                    re.IGNORECASE)
_ATTENTION_SCOPE = re.compile(r"attn|attention", re.IGNORECASE)
_EXPERT = re.compile(r"(?:^|\.)experts\.\d+\.")
_EXPERT_COUNT = re.compile(r"^(?:n|num|moe_num)_(?:local_|routed_)?experts$")
#: linears that LoRA cannot adapt on the torch island, by model type (leaf names):
#: peft refuses ``out_proj``/``conv1d`` in Mamba-style models
#: (``peft.tuners.tuners_utils._check_lora_target_modules_mamba``), and transformers'
#: Mamba mixers read some weights directly (``self.dt_proj.weight @ x``, and the
#: fused CUDA kernels ``x_proj.weight``/``out_proj.weight``), which bypasses a LoRA
#: wrapper: torch islands would train nothing there, the MLX island would.
_MAMBA1 = frozenset({"out_proj", "conv1d", "x_proj", "dt_proj"})
_MAMBA2 = frozenset({"out_proj", "conv1d"})
NOT_ADAPTABLE: dict[str, frozenset[str]] = {
    "mamba": _MAMBA1, "falcon_mamba": _MAMBA1, "jamba": frozenset({"dt_proj"}),
    **{t: _MAMBA2 for t in ("mamba2", "falcon_h1", "nemotron_h", "bamba",
                            "granitemoehybrid", "zamba2")},
}


class TargetError(ValueError):
    """A ``--lora-targets`` value that selects nothing both islands can adapt;
    the message says what was found and what to pass instead."""


def block_relative(path: str) -> str | None:
    """The path inside its decoder block (``self_attn.q_proj``), None outside the
    language model's decoder blocks."""
    m = _BLOCK.search(path)
    return path[m.end():] if m and not _TOWER.search(path) else None


def is_attention(path: str) -> bool:
    rel = block_relative(path)
    if rel is None:
        return False
    *scopes, leaf = rel.split(".")
    return leaf in ATTENTION_LEAVES or any(_ATTENTION_SCOPE.search(s) for s in scopes)


def is_expert(path: str) -> bool:
    return _EXPERT.search(path) is not None


def _expert_counts(config: dict[str, Any], depth: int = 0) -> Iterator[int]:
    for key, value in config.items():
        if isinstance(value, dict) and depth < 2:
            yield from _expert_counts(value, depth + 1)
        elif (_EXPERT_COUNT.match(str(key)) and isinstance(value, int)
              and not isinstance(value, bool)):
            yield value


def is_moe(config: dict[str, Any], linear_paths: Iterable[str] = ()) -> bool:
    """A mixture-of-experts model: an expert count > 1 in the config (also in
    ``text_config`` or ``ffn_config``), or per-expert linears among the paths."""
    return any(n > 1 for n in _expert_counts(config)) or any(map(is_expert, linear_paths))


def _holder(expert_param: str) -> str:
    """``model.layers.0.mlp`` of ``model.layers.0.mlp.experts.gate_up_proj``."""
    return expert_param.rsplit(".", 2)[0]


def routers(paths: Iterable[str], experts: Iterable[str] = ()) -> set[str]:
    """Linears that sit directly beside an ``experts`` list or a fused experts module
    (``experts``: its parameter paths): the router and its gates."""
    paths = list(paths)
    holders = {p[:m.start()] for p in paths if (m := _EXPERT.search(p))}
    holders.update(_holder(e) for e in experts)
    return {p for p in paths if not is_expert(p) and p.rsplit(".", 1)[0] in holders}


def _matches(path: str, entry: str) -> bool:
    if is_expert(path) and names_experts(entry):  # "experts", "mlp.experts", "experts.0.w1"
        return path == entry or path.endswith("." + entry) or f".{entry}." in f".{path}"
    return (path == entry or path.endswith("." + entry)) and not is_expert(path)


def _leaves(paths: Iterable[str]) -> list[str]:
    return sorted({p.rsplit(".", 1)[-1] for p in paths})


def _explicit(blocks: list[str], mode: str) -> list[str]:
    entries = [x.strip() for x in mode.split(",") if x.strip()]
    if not entries:
        raise TargetError(f"{FLAG} {mode!r}: use auto, attention, all-linear or a comma list "
                          f"of module names, e.g. {FLAG} q_proj,v_proj")
    # an entry naming experts may name fused expert weights (`select_experts`)
    unused = [e for e in entries if not names_experts(e)
              and not any(_matches(p, e) for p in blocks)]
    if unused and len(unused) < len(entries):
        log.warning("%s: %s matched no linear layer of this model", FLAG, ", ".join(unused))
    return [p for p in blocks if any(_matches(p, e) for e in entries)]


def names_experts(entry: str) -> bool:
    return "experts" in entry.split(".")


def experts_only(mode: str) -> bool:
    """A comma list whose every entry names experts (``experts``, ``mlp.experts``,
    ``experts.down_proj``): no linear outside the experts is meant."""
    entries = [x.strip() for x in mode.split(",") if x.strip()]
    return bool(entries) and mode.strip() not in TARGET_MODES and all(map(names_experts,
                                                                          entries))


def _moe_refusal(mode: str, blocks: list[str]) -> TargetError:
    example = ",".join(_leaves(p for p in blocks if is_attention(p))) or "q_proj,v_proj"
    return TargetError(
        f"{FLAG} {mode}: this is a mixture-of-experts model whose experts are neither "
        "per-expert linear layers nor fused expert weights of a module named experts "
        "(transformers' gate_up_proj / down_proj), so LoRA cannot adapt them identically on "
        f"torch and MLX islands. Use {FLAG} attention (what auto picks for mixture-of-experts "
        f"models), or list the modules to adapt, e.g. {FLAG} {example}")


def _refused(config: dict[str, Any]) -> frozenset[str]:
    return NOT_ADAPTABLE.get(str(config.get("model_type")), frozenset())


def choose(linear_paths: Iterable[str], mode: str, config: dict[str, Any],
           experts: Iterable[str] = ()) -> list[str]:
    """`select_targets` without its log lines and without the no-match error
    (an empty list then). ``experts``: the fused expert weights' parameter paths
    (their routers are never chosen)."""
    paths = sorted(set(linear_paths))
    experts = list(experts)
    refused = _refused(config)
    blocks = [p for p in paths if block_relative(p) is not None
              and p.rsplit(".", 1)[-1] not in refused]
    mode = mode.strip()
    moe = is_moe(config, paths)
    if mode == "auto" and moe:
        attention = [p for p in blocks if is_attention(p) and not is_expert(p)]
        beside = routers(blocks, experts)
        # no attention at all (a state-space MoE): the linears that are not experts
        return attention or [p for p in blocks if not is_expert(p) and p not in beside]
    if mode == "auto":
        mode = "all-linear"
    if mode == "attention":
        return [p for p in blocks if is_attention(p) and not is_expert(p)]
    if mode == "all-linear":
        beside = routers(blocks, experts)
        return [p for p in blocks if p not in beside]
    return _explicit(blocks, mode)


def is_fused_expert(param_path: str, ndim: int) -> bool:
    """A 3-D weight of a module named ``experts`` inside a decoder block (what
    transformers 5 fuses the experts into: ``mlp.experts.gate_up_proj``)."""
    module = param_path.rsplit(".", 1)[0]
    return (ndim == 3 and module.rsplit(".", 1)[-1] == "experts"
            and block_relative(module + ".") is not None)


def _expert_match(param: str, entry: str) -> bool:
    module = param.rsplit(".", 1)[0]
    return any(x == entry or x.endswith("." + entry) for x in (param, module))


def select_experts(expert_params: Iterable[str], mode: str, config: dict[str, Any],
                   linear_paths: Iterable[str] = ()) -> list[str]:
    """Parameter paths of the fused expert weights to adapt (``--lora-targets``
    ``all-linear`` or entries naming ``experts``), sorted; [] for auto and
    attention. Raises `TargetError` when the value asks for the experts of a
    mixture-of-experts model and neither fused expert weights nor per-expert
    linears are there."""
    params = sorted(set(expert_params))
    linears = sorted(set(linear_paths))
    mode = mode.strip()
    if mode in ("auto", "attention"):
        return []
    if mode == "all-linear":
        if not params and is_moe(config, linears) and not any(map(is_expert, linears)):
            raise _moe_refusal(mode, [p for p in linears if block_relative(p) is not None])
        return params
    entries = [x.strip() for x in mode.split(",") if names_experts(x.strip())]
    chosen = [p for p in params if any(_expert_match(p, e) for e in entries)]
    if entries and not chosen and not any(
            _matches(p, e) for p in linears for e in entries):
        found = ", ".join(params[:2]) or "none"
        raise TargetError(f"{FLAG} {mode}: {', '.join(entries)} matched no expert weight of "
                          f"this model (fused expert weights: {found}); pass e.g. "
                          f"{FLAG} all-linear, or {FLAG} q_proj,experts")
    return chosen


#: the order transformers registers fused expert weights in (peft nests one
#: ``ParamWrapper`` per weight in that order: the last is outermost)
EXPERT_PARAM_ORDER = ("gate_up_proj", "gate_proj", "up_proj", "down_proj")


def _param_rank(param: str) -> tuple[int, str]:
    leaf = param.rsplit(".", 1)[-1]
    order = EXPERT_PARAM_ORDER
    return (order.index(leaf) if leaf in order else len(order), leaf)


def expert_lora_module(param: str, chosen: Iterable[str]) -> str:
    """The module path peft saves the LoRA of fused expert weight ``param`` under,
    when the weights ``chosen`` are adapted: peft wraps one weight of a module per
    ``ParamWrapper``, nested in registration order, so the last one adapted is
    ``<module>`` and each earlier one a ``.base_layer`` deeper
    (``mlp.experts.base_layer`` = gate_up_proj beside down_proj)."""
    module = param.rsplit(".", 1)[0]
    same = sorted((p for p in set(chosen) | {param} if p.rsplit(".", 1)[0] == module),
                  key=_param_rank)
    return module + ".base_layer" * (len(same) - 1 - same.index(param))


def no_match_message(mode: str, linear_paths: Iterable[str]) -> str:
    """What a selection that matched nothing says: the flag, the linear layers the
    model has (leaf names, a few full paths) and a value that would work."""
    paths = sorted(set(linear_paths))
    found = [p for p in paths if block_relative(p) is not None] or paths
    head = f"{FLAG} {mode!r} matched no linear layer in the model's decoder blocks"
    if not found:
        return f"{head}, and the model has no linear layers at all (nothing LoRA can adapt)"
    leaves = _leaves(found)
    examples = [next(p for p in found if p.endswith("." + leaf)) for leaf in leaves[:3]]
    hint = (" (this model has no attention projections: try all-linear)"
            if mode.strip() == "attention" else "")
    return (f"{head}{hint}. Linear layers found: {', '.join(leaves)} (e.g. "
            f"{', '.join(examples)}). Pass some of them, e.g. {FLAG} {','.join(leaves[:2])}")


def select_targets(linear_paths: Iterable[str], mode: str, config: dict[str, Any],
                   experts: Iterable[str] = ()) -> list[str]:
    """Hugging Face module paths (inside decoder blocks) of the linears to adapt,
    sorted. ``mode`` is the ``--lora-targets`` value; ``config`` the Hugging Face
    config dict; ``experts`` the fused expert weights' parameter paths (whose
    routers are left out; the weights themselves are `select_experts`'). Raises
    `TargetError` when nothing (usable) matches."""
    paths = sorted(set(linear_paths))
    chosen = choose(paths, mode, config, experts)
    if not chosen and experts_only(mode):
        return []  # the experts alone: `select_experts` says when there are none
    if not chosen:
        raise TargetError(no_match_message(mode, paths))
    refused = sorted({p.rsplit(".", 1)[-1] for p in paths if block_relative(p) is not None}
                     & _refused(config))
    if refused and mode.strip() != "attention":
        log.info("%s: %s not adapted: LoRA cannot adapt it on the torch island in %s models "
                 "(peft refuses it, or transformers' Mamba mixer reads its weight directly)",
                 FLAG, ", ".join(refused), config.get("model_type"))
    if mode.strip() == "auto" and is_moe(config, paths):
        what = ("attention only" if all(map(is_attention, chosen))
                else "its linears that are not experts (it has no attention projections)")
        log.info("mixture-of-experts model: %s auto adapts %s (%s in %d modules); the experts "
                 "are not adapted (%s all-linear adapts them too)", FLAG, what,
                 ", ".join(_leaves(chosen)), len(chosen), FLAG)
    return chosen


def peft_key(module_path: str, which: str) -> str:
    """Canonical name of a LoRA factor: peft's saved key (no adapter name)."""
    return f"base_model.model.{module_path}.{which}.weight"
