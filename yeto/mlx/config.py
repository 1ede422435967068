"""A Hugging Face ``config.json`` as mlx-lm must read it to build the model the
checkpoint means.

mlx-lm 0.32 builds each model from a ``ModelArgs`` dataclass
(``mlx_lm/models/<model_type>.py``) filled from ``config.json`` by field name.
transformers 5 writes many configs differently from the checkpoints those files were
written against, so before mlx-lm sees a config, `config_overrides` fills every
``ModelArgs`` field the config holds under another form, driven by the fields of the
``ModelArgs`` mlx-lm will build (`args_fields`):

1. **The transformers config class itself** (the general mechanism). The dict is
   turned back into its transformers config object, and every ``ModelArgs`` field
   the dict lacks is read from it with ``getattr``: that covers the class's
   ``attribute_map`` aliases (qwen3_moe's ``num_experts`` -> ``num_local_experts``,
   exaone's ``num_layers``) and its derived attributes (properties, and values
   save_pretrained left out because they equal the class default).
2. **RoPE** (`flat_rope_overrides`). transformers >= 5 nests ``rope_theta`` and any
   scaling under ``"rope_parameters"`` (per layer type for hybrids); most mlx-lm
   models read only the flat ``rope_theta`` / ``rope_scaling`` /
   ``partial_rotary_factor`` and silently fall back to their own defaults when
   those are missing (qwen2 1e6, llama 1e4), so the MLX model computes different
   logits than torch from the same weights. ``rope_scaling`` is ``None`` for plain
   RoPE (exaone4 requires the field).
3. **transformers-5 structures, by the mlx-lm field that reads them** (`_DERIVED`):
   per-layer lists (``layer_types``, ``mlp_layer_types``) where checkpoints said
   ``full_attn_idxs``, ``sliding_window_pattern``, ``first_k_dense_replace``,
   ``moe_layer_freq``, ``is_moe_layer``; ``per_layer_config`` entries where they
   said ``global_head_dim``; the defaults the modelling code applies (``head_dim``).
   Fields that place layer kinds by a period get the period that gives the config's
   lists, else the lists go under `yeto.mlx.layer_kinds.KEY` for the layers to be
   built one by one (`_periodic`).
4. **The few per-model keys left** (`_PER_MODEL`, `_FORCED`), each naming the
   mlx-lm file that reads it; and checks of configs a model file cannot represent
   (`_CHECKS`), refused with `UnsupportedConfig`.

Composite configs (gemma3, llama4, qwen3_5: a ``text_config`` inside) get the same
translation of their ``text_config`` against mlx-lm's text-model arguments; a
text-only checkpoint of a composite model (``qwen3_5_text``, MoE ``llama4_text``)
is read by mlx-lm's composite module (`text_only_remap`; a wrapped one is marked with
`TEXT_ONLY`, for `yeto.mlx.checkpoint` to move its weights). A value already in the
config wins, except where transformers reads another key than mlx-lm (`_FORCED`,
`_FROM_LAYER_TYPES`).

`mlx_lm_classes` is the one place yeto calls a private mlx-lm name
(``mlx_lm.utils._get_classes``); tests/unit/test_mlx_lm_private.py fails, naming the
mlx-lm version, when mlx-lm changes it.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
from typing import Any

from yeto.mlx import heads, layer_kinds
from yeto.mlx.errors import UnsupportedConfig

log = logging.getLogger("yeto.mlx.config")

_MISSING = object()
TEXT_ONLY = "yeto_text_only_checkpoint"  # set in the config of a wrapped text-only checkpoint
_NONE = object()  # a rule's answer "None, explicitly" (where mlx-lm tests `is not None`)
# ModelArgs fields never read from the transformers object: RoPE is translated by
# flat_rope_overrides (transformers 5's ``rope_scaling`` attribute is an alias of
# ``rope_parameters`` with rope_theta inside, which mlx-lm takes for a scaling)
_NOT_FROM_OBJECT = {"rope_scaling", "rope_theta", "rope_parameters", "model_type",
                    "text_config", "vision_config", "audio_config", "quantization",
                    "quantization_config"}
FULL, SLIDING = "full_attention", "sliding_attention"


def _rope_dict(rope: dict) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in (None, "default"):
        # "type" too: older mlx-lm files (nemotron.py, phi3.py, qwen2_moe.py) read that key
        out["rope_scaling"] = {**{k: v for k, v in rope.items() if k != "rope_theta"},
                               "type": kind}
    if "partial_rotary_factor" in rope:
        out["partial_rotary_factor"] = rope["partial_rotary_factor"]
    return out


def flat_rope_overrides(config: dict[str, Any], reads_layered: bool = False
                        ) -> dict[str, Any]:
    """The flat RoPE keys mlx-lm reads (``rope_theta``, ``rope_scaling`` for a
    non-default type, ``partial_rotary_factor``), recovered from transformers-5
    ``rope_parameters`` (also inside ``text_config``). A per-layer-type form
    (``{"full_attention": {...}, "sliding_attention": {...}}``) gives the
    full-attention layers' values (the sliding layers' theta is `_DERIVED`'s
    ``rope_local_base_freq`` / ``swa_rope_theta``), unless ``reads_layered`` (the
    mlx-lm model reads the per-layer form itself). Empty when nothing is missing; a
    flat value already in the config wins."""
    out: dict[str, Any] = {}
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get(FULL), dict):
        rope = None if reads_layered else rope[FULL]
    if isinstance(rope, dict) and "rope_theta" in rope:
        out = {k: v for k, v in _rope_dict(rope).items() if config.get(k) is None}
    text = config.get("text_config")
    if isinstance(text, dict):
        inner = flat_rope_overrides(text)
        if inner:
            out["text_config"] = {**text, **inner}
    return out


def mlx_lm_classes(config: dict[str, Any]) -> tuple[type, type]:
    """mlx-lm's (``Model``, ``ModelArgs``) for a config, picked as mlx-lm's own loader
    picks them: ``model_type`` (or a (model type, architecture) pair) through mlx-lm's
    remapping tables (``mistral`` -> llama.py) to ``mlx_lm.models.<type>``; ValueError
    for a type mlx-lm does not have.

    mlx-lm exports nothing else that does this: ``mlx_lm.utils._get_classes``, the
    default ``get_model_classes`` of its public ``load_model``, is private, and this is
    the only place yeto calls it (tests/unit/test_mlx_lm_private.py checks it)."""
    from mlx_lm.utils import _get_classes

    return _get_classes(config)


def mlx_model_module(config: dict[str, Any]):
    """mlx-lm's model module for this config (its ``Model`` and ``ModelArgs``),
    chosen as mlx-lm chooses it (`mlx_lm_classes`), after `text_only_remap`."""
    remap = text_only_remap(config)
    if remap is not None:
        config = {**config, "model_type": remap[0]}
    return importlib.import_module(mlx_lm_classes(config)[0].__module__)


def _mlx_module(kind: str):
    try:
        return importlib.import_module(f"mlx_lm.models.{kind}")
    except ImportError:
        return None


def _has_experts(config: dict[str, Any]) -> bool:
    return any(isinstance(config.get(k), int) and config[k] > 1
               for k in ("num_local_experts", "num_experts", "n_routed_experts"))


def text_only_remap(config: dict[str, Any]) -> tuple[str, bool] | None:
    """(mlx-lm model type, wrap) for a text-only checkpoint of a composite
    (image-text) model: transformers writes it with the text model type
    (``qwen3_5_text``, ``llama4_text``), which mlx-lm knows only inside the composite
    model's module (``qwen3_5.py``, ``llama4.py``), or under the same name for another
    variant (mlx-lm's ``llama4_text.py`` is a dense model; Llama 4 text is MoE).
    ``wrap``: the composite's arguments take the text config nested as
    ``text_config`` (qwen3_5's take a flat one too). None: mlx-lm reads it as is."""
    kind = str(config.get("model_type", ""))
    if not kind.endswith("_text") or "text_config" in config:
        return None
    base = _mlx_module(kind[:-len("_text")])
    if base is None or "text_config" not in args_fields(getattr(base, "ModelArgs", None)):
        return None
    own = _mlx_module(kind)
    if own is not None:
        own_fields = args_fields(getattr(own, "ModelArgs", None))
        expert_fields = {"num_local_experts", "num_experts", "n_routed_experts"}
        if not (_has_experts(config) and not expert_fields & set(own_fields)):
            return None  # mlx-lm's own module for the type fits
    from mlx_lm.models.base import BaseModelArgs

    wrap = base.ModelArgs.from_dict.__func__ is BaseModelArgs.from_dict.__func__
    return base.__name__.rsplit(".", 1)[1], wrap


def args_fields(args_cls) -> dict[str, tuple[bool, str]]:
    """{field name: (required, type annotation as text)} of an mlx-lm
    ``ModelArgs``-like class."""
    try:
        params = inspect.signature(args_cls).parameters
    except (TypeError, ValueError):
        return {}
    return {k: (p.default is inspect.Parameter.empty, str(p.annotation))
            for k, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def _text_args_class(module, text_config: dict, own_first: bool = False):
    """The mlx-lm arguments class a composite model builds its text model from: the
    ``ModelArgs`` of mlx-lm's module for the text model type (gemma3 -> gemma3_text),
    else a ``*Text*`` args class of the model's own module (llama4 ``TextArgs``,
    qwen3_5 ``TextModelArgs``, gemma3n ``TextConfig``)."""
    from mlx_lm.models.base import BaseModelArgs

    # its own module's, else that of the module its Model derives from (qwen3_5_moe.py's
    # Model is qwen3_5.py's, built from qwen3_5.TextModelArgs)
    homes = [module] + [importlib.import_module(c.__module__)
                        for c in getattr(module, "Model", object).__mro__[1:]
                        if c.__module__.startswith("mlx_lm.models.")]
    own = next((obj for home in homes for name, obj in vars(home).items()
                if inspect.isclass(obj) and issubclass(obj, BaseModelArgs) and "Text" in name
                and obj.__module__ == home.__name__), None)
    if own is not None and own_first:
        return own
    kind = text_config.get("model_type")
    if kind:
        try:
            return importlib.import_module(f"mlx_lm.models.{kind}").ModelArgs
        except (ImportError, AttributeError):
            pass
    return own


def _hf_config(config: dict[str, Any]):
    """The transformers config object of a config.json dict (None when transformers
    does not know the model type)."""
    try:
        from transformers import AutoConfig
    except ImportError:
        return None
    kind = config.get("model_type")
    try:
        return AutoConfig.for_model(kind, **{k: v for k, v in config.items()
                                             if k != "model_type"})
    except Exception as e:  # noqa: BLE001 - a config transformers cannot read: no step 1
        log.debug("config shim: transformers cannot read a %s config: %s", kind, e)
        return None


def _plain(value: Any) -> Any:
    """A JSON-like copy of a config value (sub-configs as dicts)."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, tuple):
        return list(value)
    return value


def _from_object(hf, name: str, required: bool) -> Any:
    if hf is None or name in _NOT_FROM_OBJECT:
        return _MISSING
    try:
        value = getattr(hf, name, _MISSING)
    except Exception:  # noqa: BLE001 - attributes transformers refuses to read globally
        return _MISSING
    if value is _MISSING or (value is None and not required):
        return _MISSING
    value = _plain(value)
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return _MISSING
    return value


def _translate(config: dict[str, Any], args_cls, hf, parent: dict | None = None
               ) -> dict[str, Any]:
    """Overrides for one level of config against one mlx-lm arguments class."""
    fields = args_fields(args_cls)
    out = flat_rope_overrides({k: v for k, v in config.items() if k != "text_config"},
                              reads_layered="rope_parameters" in fields)
    have = {**config, **out}

    def put(name: str, value: Any) -> None:
        if value is _NONE:
            out[name] = have[name] = None
        elif value is not _MISSING and value is not None:
            out[name] = have[name] = value

    for name, (required, _) in fields.items():  # 1: the transformers config object
        if have.get(name) is None:
            put(name, _from_object(hf, name, required))
    for name, (_, annotation) in fields.items():  # 3: transformers-5 structures
        rule = _DERIVED.get(name)
        if rule is not None and (have.get(name) is None or name in _FROM_LAYER_TYPES):
            put(name, rule(have, annotation))
    for name, rule in _PER_MODEL.get(config.get("model_type"), {}).items():
        if name in fields and have.get(name) is None:
            put(name, rule(have))
    for name, rule in _FORCED.get(config.get("model_type"), {}).items():
        if name in fields:
            put(name, rule(have))
    for name in fields:
        if have.get(name) is None and parent is not None and parent.get(name) is not None:
            put(name, parent[name])  # a composite's text model field kept at the top
        if name not in have and parent is None and isinstance(config.get("text_config"), dict):
            put(name, config["text_config"].get(name))  # moved into text_config
    if "rope_scaling" in fields and fields["rope_scaling"][0] and "rope_scaling" not in have:
        out["rope_scaling"] = None  # plain RoPE; exaone4's ModelArgs requires the field
    _periodic(have, fields, out, args_cls)
    _one_kind_lists(have, fields, out)
    put("head_dim", heads.transformers_head_dim(have, hf))  # widened by heads.fit_heads
    if "text_config" not in fields and have.get("model_type") in _CHECKS:
        _CHECKS[have["model_type"]](have, args_cls)
    return out


def _fit(n: int, special: list[bool], rule) -> int | None:
    """The smallest period v in 1..n+1 with rule(v, i) == special[i] for every layer."""
    return next((v for v in range(1, n + 2) if all(rule(v, i) == s for i, s in enumerate(special))),
                None)


# mlx-lm field -> (transformers list, which entries it marks, mlx-lm's rule for layer i)
def _moe_marks(c: dict) -> list[bool] | None:
    """Llama 4's ``moe_layers`` (indices) as one flag per layer."""
    n, moe = c.get("num_hidden_layers"), c.get("moe_layers")
    return [i in moe for i in range(n)] if isinstance(moe, list) and isinstance(n, int) else None


def _kind_marks(key: str, marks):
    return lambda c: ([marks(t) for t in c[key]] if isinstance(c.get(key), list) and c[key]
                      else None)


# mlx-lm field -> (the list transformers reads, as flags per layer; mlx-lm's rule for
# whether layer i is flagged under the field's value v)
_PERIODS = {
    "full_attention_interval": (_kind_marks("layer_types", lambda t: t == FULL),
                                lambda v, i: (i + 1) % v == 0),
    "sliding_window_pattern": (_kind_marks("layer_types", lambda t: t != SLIDING),
                               lambda v, i: (i + 1) % v == 0),
    "interleave_moe_layer_step": (_moe_marks, lambda v, i: i % v == v - 1),
}


def _periodic(have: dict, fields: dict, out: dict, args_cls) -> None:
    """mlx-lm fields that place layers of a kind periodically (every v-th layer global,
    the first k dense then MoE every f-th), set so that they give transformers' per-layer
    lists; where no period in range does, the kinds go under `layer_kinds.KEY` for
    `layer_kinds.rebuild_layers` (and the period is set to 1, a value the model file can
    index with)."""
    kinds: dict[str, list[bool]] = {}
    for name, (marks_of, rule) in _PERIODS.items():
        marks = marks_of(have)
        if name not in fields or marks is None or "str" in fields[name][1]:
            continue
        v = _fit(len(marks), marks, rule)
        if v is None and "layer_types" in fields:
            continue  # the model file reads the list itself (gemma4_text.py)
        if v is None or v > len(marks):
            kinds[name], v = marks, 1
        out[name] = have[name] = v
    mlp = _mlp_types(have)
    if mlp is not None and "first_k_dense_replace" in fields and "moe_layer_freq" in fields \
            and "int" in fields["moe_layer_freq"][1]:
        sparse = [t != "dense" for t in mlp]
        k = sparse.index(True) if any(sparse) else len(mlp)
        f = _fit(len(mlp), sparse, lambda v, i: i >= k and i % v == 0)
        if f is None:
            kinds["first_k_dense_replace"], k, f = sparse, 0, 1
        out["first_k_dense_replace"], out["moe_layer_freq"] = k, f
    if kinds:
        out[layer_kinds.KEY] = have[layer_kinds.KEY] = kinds


def _llama4_layers(have: dict, args_cls) -> None:
    """mlx_lm/models/llama4.py hard-codes Llama 4's layer plan, which
    `yeto.mlx.models.llama4.follow_config` replaces by the config's ``no_rope_layers``
    (1 = rotate) and ``layer_types``: each list must give one known kind per layer."""
    n = have.get("num_hidden_layers")
    for key, kinds in (("no_rope_layers", (0, 1)),
                       ("layer_types", ("chunked_attention", "full_attention"))):
        value = have.get(key)
        if value is not None and (not isinstance(value, list) or len(value) != n
                                  or any(v not in kinds for v in value)):
            raise UnsupportedConfig(f"{key}={value}: Llama 4 needs one of {kinds} for each of "
                                    f"its num_hidden_layers={n} layers")
    if "chunked_attention" in (have.get("layer_types") or []) and not isinstance(
            have.get("attention_chunk_size"), int):
        raise UnsupportedConfig(f"attention_chunk_size={have.get('attention_chunk_size')}: "
                                "chunked_attention layers need a chunk size (an int)")


# model type -> a check of a config the model file cannot represent
_CHECKS = {"llama4": _llama4_layers, "llama4_text": _llama4_layers}


_OTHER = {FULL: SLIDING, SLIDING: FULL, 0: 1, 1: 0, "L": "G", "G": "L"}
# model files that look up the first layer of each kind in a per-layer list
_INDEXES_KINDS = {"gpt_oss", "olmo3", "mimo_v2_flash", "exaone4", "gemma3n", "gemma3n_text",
                  "afmoe"}
# ... and slice the layers that own a cache as layer_types[:layers - num_kv_shared_layers]
_SLICES_KINDS = {"gemma3n", "gemma3n_text"}
# ... and build one layer per entry (afmoe.py: enumerate(layer_types)): `_drop_appended_layer`
_BUILDS_PER_KIND = {"afmoe"}


def _one_kind_lists(have: dict, fields: dict, out: dict) -> None:
    """A per-layer list mlx-lm reads with one kind only gets the other kind appended
    past the last layer: gpt_oss.py, olmo3.py, mimo_v2_flash.py, exaone4.py and
    gemma3n.py look up the first layer of each kind
    (``layer_types.index("sliding_attention")``) to pick a cache for its mask, and fail
    without one; no layer is built from the extra entry
    (layers are built for range(num_hidden_layers); afmoe.py builds one from it, which
    `_drop_appended_layer` drops), and the index it gives, past the last layer,
    `layer_kinds.repair_indices` points at layer 0."""
    n = have.get("num_hidden_layers")
    if have.get("model_type") not in _INDEXES_KINDS:
        return
    for name in ("layer_types", "hybrid_layer_pattern", "sliding_window_pattern"):
        value = have.get(name)
        if name not in fields or not isinstance(value, (list, str)) or len(value) != n:
            continue
        kinds = set(value)
        if len(kinds) != 1 or next(iter(kinds)) not in _OTHER:
            continue
        if have["model_type"] in _SLICES_KINDS:
            if have.get("num_kv_shared_layers") != 0:
                continue  # a shared layer reads the last cache of its kind: left to refuse
            # gemma3n.py finds each kind among layer_types[:n - num_kv_shared_layers]: -1
            # takes the appended entry in (no layer shares, either way), and
            # `layer_kinds.repair_indices` sets the bound it gives back to n
            out["num_kv_shared_layers"] = have["num_kv_shared_layers"] = -1
        out[name] = have[name] = value + (type(value)([_OTHER[value[0]]])
                                          if isinstance(value, list) else _OTHER[value[0]])


def config_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """What to add to a config.json dict so that mlx-lm reads it as the checkpoint
    means it (see the module docstring); a value already there is replaced only
    where mlx-lm would read it differently from transformers (`_FROM_LAYER_TYPES`)."""
    module = mlx_model_module(config)
    hf = _hf_config(config)
    remap = text_only_remap(config)
    if remap is not None:
        kind, wrap = remap
        text_cls = _text_args_class(module, config, own_first=True) or module.ModelArgs
        inner = {**config, **_translate(config, text_cls, hf)}
        if not wrap:
            return {**inner, "model_type": kind}
        return {"model_type": kind, "text_config": inner, TEXT_ONLY: True}
    out = _translate(config, module.ModelArgs, hf)
    text = config.get("text_config")
    if isinstance(text, dict):
        text_cls = _text_args_class(module, text)
        if text_cls is not None:
            inner = _translate({**text, **out.get("text_config", {})}, text_cls,
                               getattr(hf, "text_config", None), parent=config)
            if inner:
                out["text_config"] = {**text, **out.get("text_config", {}), **inner}
    return out


# ---- transformers-5 structures, by the mlx-lm field that reads them ------------------
def rope_of(config: dict, layer_type: str, key: str = "rope_theta") -> Any:
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get(layer_type), dict):
        return rope[layer_type].get(key)
    return rope.get(key) if isinstance(rope, dict) and layer_type == FULL else None


def layer_types_of(config: dict) -> list[str] | None:
    types = config.get("layer_types")
    return types if isinstance(types, list) and types else None


def _mlp_types(config: dict) -> list[str] | None:
    types = config.get("mlp_layer_types")
    return types if isinstance(types, list) and types else None


def _leading_dense(config: dict) -> int | None:
    types = _mlp_types(config)
    if types is None:
        return None
    return next((i for i, t in enumerate(types) if t != "dense"), len(types))


def _moe_layer_freq(config: dict, annotation: str) -> Any:
    types = _mlp_types(config)
    if types is None:
        return None
    if "List" in annotation or "list" in annotation:
        return [int(t != "dense") for t in types]
    return 1


def _sliding_window_pattern(config: dict, annotation: str) -> Any:
    """exaone4.py reads a string ("LLLG": L local, G global, cycled); the others an
    int period (every n-th layer global)."""
    types = layer_types_of(config)
    current = config.get("sliding_window_pattern")
    if types is None:
        return None
    if "str" in annotation:
        pattern = "".join("L" if t == SLIDING else "G" for t in types)
        # no sliding layer: None (exaone4.py looks for an "L" in any pattern it is given)
        return _NONE if "L" not in pattern else pattern
    if current is not None:
        return None
    full = [i for i, t in enumerate(types) if t != SLIDING]
    return full[0] + 1 if full else None


def _head_dim(c: dict) -> int | None:
    if c.get("hidden_size") and c.get("num_attention_heads"):
        return c["hidden_size"] // c["num_attention_heads"]
    return None


def _full_attn_idxs(c: dict, _annotation: str) -> list[int] | None:
    """lfm2.py builds attention where ``full_attn_idxs`` says; transformers reads
    ``layer_types``, so that decides (the two can disagree in a config)."""
    types = layer_types_of(c)
    if types is None:
        return None
    # no attention layer: an index past the end (lfm2.py reads the list's first entry;
    # layer_kinds.repair_indices then points it at layer 0, whose mask no layer uses)
    return [i for i, t in enumerate(types) if t == FULL] or [len(types)]


def _per_layer(c: dict, key: str) -> Any:
    """A value transformers 5 moved into ``per_layer_config`` (gemma4: the
    full-attention layers' head_dim and key/value heads, once ``global_head_dim`` /
    ``num_global_key_value_heads``)."""
    layers = c.get("per_layer_config")
    if not isinstance(layers, dict):
        return None
    return next((e[key] for e in layers.values() if isinstance(e, dict) and key in e),
                c.get(key))  # no entry: the same as every layer


# fields derived from transformers' own structures whenever mlx-lm would read them
# differently (they replace a value already in the config)
_FROM_LAYER_TYPES = {"full_attn_idxs", "sliding_window_pattern"}

# mlx-lm field -> its value from a transformers-5 config (when the config lacks it)
_DERIVED: dict[str, Any] = {
    "head_dim": lambda c, a: _head_dim(c),  # the modelling code's default
    "full_attn_idxs": _full_attn_idxs,
    "sliding_window_pattern": _sliding_window_pattern,
    # mixture of experts: transformers 5 lists dense/sparse per layer (mlp_layer_types)
    # where checkpoints said first_k_dense_replace / moe_layer_freq / is_moe_layer
    "first_k_dense_replace": lambda c, a: _leading_dense(c),
    "moe_layer_freq": _moe_layer_freq,
    "is_moe_layer": lambda c, a: ([t != "dense" for t in _mlp_types(c)]
                                  if _mlp_types(c) else None),
    "global_head_dim": lambda c, a: _per_layer(c, "head_dim"),
    "num_global_key_value_heads": lambda c, a: _per_layer(c, "num_key_value_heads"),
    # the sliding-window layers' RoPE base (gemma3_text.py, mimo_v2_flash.py)
    "rope_local_base_freq": lambda c, a: rope_of(c, SLIDING),
    "swa_rope_theta": lambda c, a: rope_of(c, SLIDING),
    # the same value under another name in some mlx-lm files
    "layernorm_epsilon": lambda c, a: c.get("rms_norm_eps") or c.get("layer_norm_epsilon"),
    # GPT-2 family (gpt2.py, gpt_bigcode.py): context and MLP width under the old names,
    # None meaning transformers' default 4 x n_embd
    "n_ctx": lambda c, a: c.get("n_positions"),
    "n_inner": lambda c, a: 4 * c["n_embd"] if c.get("n_embd") else None,
    "rotary_dim": lambda c, a: (int((c.get("head_dim") or _head_dim(c) or 0)
                                    * (c.get("partial_rotary_factor") or 1.0)) or None),
}

def _kimi_linear_attn(c: dict) -> dict | None:
    """mlx_lm/models/kimi_linear.py reads Kimi-Linear's original nested
    ``linear_attn_config`` (1-based layer numbers); transformers 5 flattens it into
    linear_* keys and ``layer_types``."""
    types = layer_types_of(c)
    if types is None or c.get("linear_head_dim") is None:
        return None
    return {"head_dim": c["linear_head_dim"], "num_heads": c.get("linear_num_heads"),
            "short_conv_kernel_size": c.get("linear_conv_kernel_dim", 4),
            # (1-based; an empty list gets a number past the last layer, as
            # _one_kind_lists does: kimi_linear.py reads each list's first entry)
            "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"]
            or [len(types) + 1],
            "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == FULL]
            or [len(types) + 1]}


# Per-model keys under names only one mlx-lm model file reads.
_PER_MODEL: dict[str, dict[str, Any]] = {
    # mlx_lm/models/lfm2.py: the conv/attention block width, ``block_dim`` in LFM2's
    # original config, is the hidden size (transformers 5 dropped the key)
    "lfm2": {"block_dim": lambda c: c.get("hidden_size")},
    # mlx_lm/models/gpt_neox.py: GPT-NeoX's original names for RoPE base and fraction
    "gpt_neox": {"rotary_emb_base": lambda c: c.get("rope_theta") or rope_of(c, FULL),
                 "rotary_pct": lambda c: (c.get("partial_rotary_factor")
                                          or rope_of(c, FULL, "partial_rotary_factor"))},
    # mlx_lm/models/glm_moe_dsa.py: the router of GLM-5 checkpoints (sigmoid scores,
    # bias-corrected top-k), which transformers' GlmMoeDsa hard-codes
    "glm_moe_dsa": {"topk_method": lambda c: "noaux_tc", "scoring_func": lambda c: "sigmoid"},
    # mlx_lm/models/kimi_linear.py: the KDA layout, and a RoPE base its MLA never uses
    # (Kimi-Linear's MLA has no rotary embedding, in transformers nor in mlx-lm)
    "kimi_linear": {"linear_attn_config": _kimi_linear_attn, "rope_theta": lambda c: 10000.0},
    # mlx_lm/models/mamba2.py requires the SSM inner width (transformers derives it)
    "mamba2": {"intermediate_size": lambda c: (c["expand"] * c["hidden_size"]
                                               if c.get("expand") else None)},
    # mlx_lm/models/solar_open.py: every Solar-Open layer is MoE in transformers (no
    # leading dense layers, so the dense width is unused) and RoPE rotates the whole head
    "solar_open": {"first_k_dense_replace": lambda c: 0,
                   "intermediate_size": lambda c: c.get("moe_intermediate_size"),
                   "partial_rotary_factor": lambda c: rope_of(c, FULL,
                                                               "partial_rotary_factor") or 1.0},
    # mlx_lm/models/longcat_flash.py: what transformers' LongcatFlash hard-codes (MLA
    # with both latent scales, identity zero-experts), as in LongCat-Flash checkpoints
    "longcat_flash": {"attention_method": lambda c: "MLA",
                      "zero_expert_type": lambda c: "identity",
                      "mla_scale_q_lora": lambda c: True, "mla_scale_kv_lora": lambda c: True},
    # mlx_lm/models/mimo_v2_flash.py: MiMo-V2-Flash's original keys; transformers keeps
    # layer_types / mlp_layer_types and hard-codes the rest: sliding-window layers with
    # twice the key/value heads and attention sinks, full layers without, a sigmoid
    # bias-corrected router, no shared experts, sliding_window = window size + 1
    "mimo_v2_flash": {
        "hybrid_layer_pattern": lambda c: ([int(t == SLIDING) for t in c["layer_types"]]
                                           if layer_types_of(c) else None),
        "add_swa_attention_sink_bias": lambda c: True,
        "add_full_attention_sink_bias": lambda c: False,
        "sliding_window_size": lambda c: (c["sliding_window"] - 1
                                          if c.get("sliding_window") else None),
        "n_shared_experts": lambda c: _NONE,
        "topk_method": lambda c: "noaux_tc", "scoring_func": lambda c: "sigmoid",
        "swa_num_attention_heads": lambda c: c.get("num_attention_heads"),
        "swa_num_key_value_heads": lambda c: (2 * c["num_key_value_heads"]
                                              if c.get("num_key_value_heads") else None),
        "swa_head_dim": lambda c: c.get("head_dim"),
        "swa_v_head_dim": lambda c: c.get("v_head_dim")},
    # mlx_lm/models/apertus.py requires three flags transformers' Apertus hard-codes
    # (no MLP bias, QK-norm, pre-norm), as in Apertus checkpoints
    "apertus": {"mlp_bias": lambda c: False, "qk_norm": lambda c: True,
                "post_norm": lambda c: False},
}


def _dbrx_attn_config(c: dict) -> dict | None:
    theta = rope_of(c, FULL)
    attn = c.get("attn_config")
    return None if theta is None or not isinstance(attn, dict) else {**attn, "rope_theta": theta}


_GRANITE_LAYERS = {"linear_attention": "mamba", "full_attention": "attention"}

# Per-model values transformers reads from another key than mlx-lm: the key mlx-lm
# reads is rewritten from the one transformers reads, even when the config has both.
_FORCED: dict[str, dict[str, Any]] = {
    # mlx_lm/models/dbrx.py reads attn_config.rope_theta; transformers 5 rope_parameters
    "dbrx": {"attn_config": _dbrx_attn_config},
    # mlx_lm/models/granitemoehybrid.py knows the layer types as "mamba"/"attention";
    # transformers 5 writes "linear_attention"/"full_attention"
    # "linear_attention"/"full_attention"; and transformers rotates only for
    # position_embedding_type "rope" where mlx-lm skips RoPE only for "nope"
    "granitemoehybrid": {
        "layer_types": lambda c: ([_GRANITE_LAYERS.get(t, t) for t in c["layer_types"]]
                                  if layer_types_of(c) else None),
        "position_embedding_type": lambda c: ("rope" if c.get("position_embedding_type") == "rope"
                                              else "nope")},
    # transformers' KimiLinearForCausalLM never ties its head (``_tied_weights_keys = {}``):
    # it reads lm_head.weight whatever tie_word_embeddings says; mlx_lm/models/kimi_linear.py
    # ties when told to and drops the checkpoint's head in sanitize
    "kimi_linear": {"tie_word_embeddings": lambda c: False},
}
