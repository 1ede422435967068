"""LoRA target selection (`yeto.targets`), transformers' Conv1D in peft, and the
MLX island's mapping of mlx-lm module paths to Hugging Face module paths.

Here: the checks through in-process servers, training or the sim (the others:
tests/unit/test_targets.py)."""


from __future__ import annotations

import re

import numpy as np
import pytest

from yeto.targets import TargetError

GPT2 = dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=96)


# ---- transformers' Conv1D in peft ---------------------------------------------
def test_conv1d_lora_is_peft_fan_in_fan_out_and_a_plain_merge():
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    from yeto.torch.model import attach_lora

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", **GPT2)).eval()
    reference = AutoModelForCausalLM.from_config(base.config).eval()
    reference.load_state_dict(base.state_dict())
    r, alpha = 4, 8.0
    model = attach_lora(base, r, alpha, "all-linear", 0)
    assert model.peft_config["default"].fan_in_fan_out
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (2, 10), generator=gen)
    modules = dict(reference.named_modules())
    with torch.no_grad():
        before = reference(ids).logits
        for name, m in model.named_modules():
            if not hasattr(m, "lora_A") or "default" not in m.lora_A:
                continue
            a, b = m.lora_A["default"].weight, m.lora_B["default"].weight
            assert isinstance(m.base_layer, Conv1D) and m.fan_in_fan_out
            conv = m.base_layer.weight  # (in, out)
            assert tuple(a.shape) == (r, conv.shape[0]) and tuple(b.shape) == (conv.shape[1], r)
            a.copy_(torch.randn(a.shape, generator=gen) * 0.2)
            b.copy_(torch.randn(b.shape, generator=gen) * 0.2)
            # Conv1D computes x @ W + b with W (in, out): the merge adds (B @ A)ᵀ
            target = modules[name.removeprefix("base_model.model.")]
            target.weight += (alpha / r) * (b @ a).T
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert (want - before).abs().max().item() > 1e-3  # the adapter does change the output
    assert (got - want).abs().max().item() < 1e-5


# ---- MLX: mlx-lm module paths -> Hugging Face module paths ----------------------
def _mlx():
    pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'yeto[mlx]')")
    import mlx.core as mx
    import mlx.nn as nn

    return mx, nn


def _toy_mlx_model(fuse_qkv: bool):
    """An mlx-lm-shaped model whose ``sanitize`` does what mlx-lm's gpt2 and gpt_neox
    do: renames ``transformer.h.N`` to ``model.h.N`` and transposes Conv1D weights;
    with ``fuse_qkv`` it also splits the HF ``c_attn`` into three linears."""
    mx, nn = _mlx()

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            if fuse_qkv:
                self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
            else:
                self.c_attn = nn.Linear(8, 24)
            self.c_proj = nn.Linear(8, 8)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attn()

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.h = [Block(), Block()]

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()

        def sanitize(self, weights):
            out = {}
            for k, v in weights.items():
                k = "model." + k.removeprefix("transformer.")
                if k.endswith(".weight"):
                    v = v.T  # Conv1D (in, out) -> Linear (out, in)
                if fuse_qkv and ".c_attn." in k:
                    for name, part in zip("qkv", mx.split(v, 3, axis=0)):
                        out[k.replace("c_attn", name)] = part
                else:
                    out[k] = v
            return out

    hf = {f"transformer.h.{i}.attn.{m}.{w}": s for i in range(2)
          for m, s in (("c_attn", (8, 24)), ("c_proj", (8, 8)))
          for w, s in (("weight", s), ("bias", (s[1],)))}
    model = Toy()
    rng = np.random.default_rng(0)
    hf_arrays = {k: rng.standard_normal(s).astype(np.float32) for k, s in hf.items()}
    model.load_weights(list(model.sanitize({k: mx.array(v)
                                            for k, v in hf_arrays.items()}).items()))
    return model, hf, hf_arrays


def test_mlx_paths_map_to_hugging_face_paths_through_sanitize():
    mx, _ = _mlx()
    from yeto.mlx.lora import LoRAWeights, attach_lora, hf_module_paths, hf_origins

    model, hf, hf_arrays = _toy_mlx_model(fuse_qkv=False)
    origins = hf_origins(model, hf)
    assert origins["model.h.1.attn.c_attn"].kind == "transposed"
    assert origins["model.h.1.attn.c_attn"].tensors == ("transformer.h.1.attn.c_attn.weight",)
    assert hf_module_paths(model, hf)["model.h.0.attn.c_proj"] == "transformer.h.0.attn.c_proj"

    r, alpha = 2, 6.0
    layers = attach_lora(model, {}, r, alpha, "attention", 0, hf_weight_names=hf)
    assert sorted(layers) == sorted(k[:-len(".weight")] for k in hf if k.endswith(".weight"))
    names = [spec.name for spec in LoRAWeights(layers).layout.specs]
    # the whole-model view names alike
    assert names == [spec.name for spec in LoRAWeights(model).layout.specs]
    assert "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight" in names
    view = LoRAWeights(layers)
    assert view.tensors()["base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"].shape \
        == (24, r)

    # the same function as peft on the Conv1D: x @ (W + scale (B @ A)ᵀ) + b, W (in, out)
    rng = np.random.default_rng(2)
    view.set(rng.standard_normal(view.layout.numel).astype(np.float32))
    t = view.tensors()
    layer = layers["transformer.h.0.attn.c_attn"]
    x = rng.standard_normal((3, 8)).astype(np.float32)
    a = t["base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"]
    b = t["base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"]
    w, bias = hf_arrays["transformer.h.0.attn.c_attn.weight"], \
        hf_arrays["transformer.h.0.attn.c_attn.bias"]
    want = x @ (w + (alpha / r) * (b @ a).T) + bias
    np.testing.assert_allclose(np.asarray(layer(mx.array(x))), want, rtol=1e-5, atol=1e-5)


def test_mlx_refuses_a_hugging_face_linear_that_mlx_lm_splits():
    _mlx()
    from yeto.mlx.lora import attach_lora, hf_origins

    model, hf, _ = _toy_mlx_model(fuse_qkv=True)
    origins = hf_origins(model, hf)
    assert origins["model.h.0.attn.k"].kind == "part"
    assert origins["model.h.0.attn.k"].tensors == ("transformer.h.0.attn.c_attn.weight",)
    with pytest.raises(TargetError) as e:
        attach_lora(model, {}, 2, 4.0, "attention", 0, hf_weight_names=hf)
    msg = str(e.value)
    assert re.search(r"splits the Hugging Face linear transformer\.h\.\d\.attn\.c_attn into 3",
                     msg)
    assert "--lora-targets c_proj" in msg
    layers = attach_lora(model, {}, 2, 4.0, "c_proj", 0, hf_weight_names=hf)
    assert sorted(layers) == ["transformer.h.0.attn.c_proj", "transformer.h.1.attn.c_proj"]


def _toy_loader(sanitize, modules):
    """A model of ``modules`` ({path: module}) whose ``sanitize`` is ``sanitize``."""
    _, nn = _mlx()

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [nn.Module()]
            for path, module in modules.items():
                setattr(self.layers[0], path, module)

        def sanitize(self, weights):
            return sanitize(weights)

    return Toy()


def test_mlx_refuses_weights_that_mlx_lm_computes_or_mixes_into_another_layer():
    mx, nn = _mlx()
    from yeto.mlx.lora import attach_lora

    class MultiLinear(nn.Module):  # per-head weights, as mlx-lm's deepseek keeps kv_b_proj
        def __init__(self):
            super().__init__()
            self.weight = mx.zeros((3, 4, 4))

    hf = {"layers.0.q_proj.weight": (4, 4), "layers.0.o_proj.weight": (4, 4),
          "layers.0.kv_b_proj.weight": (8, 4), "layers.0.sink": (1, 4, 4)}

    def sanitize(w):
        w = dict(w)
        w["layers.0.o_proj.weight"] = w["layers.0.o_proj.weight"] + 1.0  # not a scaling
        kv = w.pop("layers.0.kv_b_proj.weight").reshape(2, 4, 4)
        w["layers.0.embed_q.weight"] = mx.concatenate([kv, w.pop("layers.0.sink")])
        return w

    def toy():
        return _toy_loader(sanitize, {"q_proj": nn.Linear(4, 4, bias=False),
                                      "o_proj": nn.Linear(4, 4, bias=False),
                                      "embed_q": MultiLinear()})

    with pytest.raises(TargetError, match=r"mlx-lm computes the weight of layers\.0\.o_proj"):
        attach_lora(toy(), {}, 2, 4.0, "q_proj,o_proj", 0, hf_weight_names=hf)
    with pytest.raises(TargetError, match=r"kv_b_proj into MultiLinear \(layers\.0\.embed_q"
                                          r"\.weight\) together with other weights.*"
                                          r"--lora-targets q_proj"):
        attach_lora(toy(), {}, 2, 4.0, "q_proj,kv_b_proj", 0, hf_weight_names=hf)
    assert list(attach_lora(toy(), {}, 2, 4.0, "q_proj", 0, hf_weight_names=hf)) == [
        "layers.0.q_proj"]


def test_mlx_lora_on_weights_with_folded_multipliers():
    """mlx-lm folds multipliers into some weights (falcon_h1: diag(out) · W · diag(in));
    the torch model applies them around its linear, so to peft's update as well."""
    mx, nn = _mlx()
    from yeto.mlx.lora import LoRAWeights, attach_lora, hf_origins

    out_m = np.array([1.0, 2.0, 0.5, 3.0, 1.5, 0.25], np.float32)
    in_m = np.float32(0.75)
    hf = {"layers.0.up_proj.weight": (6, 4)}

    def sanitize(w):
        return {k: v * mx.array(out_m)[:, None] * in_m for k, v in w.items()}

    model = _toy_loader(sanitize, {"up_proj": nn.Linear(4, 6, bias=False)})
    w = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)
    model.load_weights(list(sanitize({"layers.0.up_proj.weight": mx.array(w)}).items()))
    origin = hf_origins(model, hf)["layers.0.up_proj"]
    assert origin.kind == "scaled" and origin.exact
    r, alpha = 2, 6.0
    layers = attach_lora(model, {}, r, alpha, "up_proj", 0, hf_weight_names=hf)
    view = LoRAWeights(layers)
    assert [s.name for s in view.layout.specs] == [
        "base_model.model.layers.0.up_proj.lora_A.weight",
        "base_model.model.layers.0.up_proj.lora_B.weight"]  # the scales are not trained
    view.set(np.random.default_rng(1).standard_normal(view.layout.numel).astype(np.float32))
    t = view.tensors()
    a, b = t["base_model.model.layers.0.up_proj.lora_A.weight"], \
        t["base_model.model.layers.0.up_proj.lora_B.weight"]
    x = np.random.default_rng(2).standard_normal((3, 4)).astype(np.float32)
    want = ((x * in_m) @ (w + (alpha / r) * b @ a).T) * out_m  # torch: around peft's linear
    got = np.asarray(layers["layers.0.up_proj"](mx.array(x)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ---- transformers' load-time renames, without torch ----------------------------
MODULE_PATHS = [f"{p}.weight" for p in (
    "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj",
    "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj", "model.layers.1.mixer.in_proj",
    "model.layers.1.mixer.out_proj", "model.layers.1.mlp.shared_experts.up_proj",
    "model.layers.0.self_attn.forget_gate.f_a_proj", "model.layers.0.feed_forward.w1",
    "model.layers.0.mlp.router", "model.embed_tokens", "lm_head", "model.norm",
    "model.language_model.layers.0.self_attn.q_proj", "transformer.h.0.attn.c_attn")]


def test_renames_read_without_torch_equal_transformers():
    """`yeto.mlx.hf_renames` (transformers' rename rules read from its source, applied
    without torch) renames every checkpoint key as transformers itself does, for every
    model type transformers has rules for."""
    pytest.importorskip("torch")
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, apply_renamings

    from yeto.mlx.hf_renames import _table, renamer

    checked = 0
    for model_type in sorted(k for k in _table() if k != "legacy"):
        real = [t for t in (get_checkpoint_conversion_mapping(model_type) or [])
                + get_checkpoint_conversion_mapping("legacy") if type(t) is WeightRenaming]
        if not real:
            continue
        # checkpoint keys as transformers saves them: the module paths renamed back
        legacy = {apply_renamings(k, [t.reverse_transform() for t in reversed(real)])
                  for k in MODULE_PATHS}
        mine = renamer({"model_type": model_type})
        for key in sorted(legacy | set(MODULE_PATHS)):
            assert mine(key) == apply_renamings(key, real), (model_type, key)
        checked += 1
    assert checked > 50
    exaone = renamer({"model_type": "exaone", "architectures": ["ExaoneForCausalLM"]})
    assert exaone("transformer.h.3.attn.attention.out_proj.weight") == \
        "model.layers.3.self_attn.o_proj.weight"


def test_delta_lora_on_a_linear_mlx_lm_keeps_as_other_layers():
    """deepseek's kv_b_proj: mlx-lm keeps it as two per-head MultiLinear (one half
    transposed). `DeltaLoRA` adds peft's update through the split: same output and
    same gradients as a LoRALinear on the unsplit weight."""
    mx, nn = _mlx()
    from mlx.utils import tree_flatten

    from yeto.mlx.lora import DeltaLoRA, LoRALinear, LoRAWeights, attach_lora

    class Half(nn.Module):
        def __init__(self, transposed: bool):
            super().__init__()
            self.transposed = transposed
            self.weight = mx.zeros((4, 4))

        def __call__(self, x):
            return x @ (self.weight if self.transposed else self.weight.T)

    class Split(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [nn.Module()]
            self.layers[0].top, self.layers[0].bottom = Half(False), Half(True)

        def __call__(self, x):
            b = self.layers[0]
            return mx.concatenate([b.top(x), b.bottom(x)], axis=-1)

        def sanitize(self, w):
            v = w.pop("layers.0.kv_b_proj.weight")
            return {"layers.0.top.weight": v[:4], "layers.0.bottom.weight": v[4:].T}

    hf = {"layers.0.kv_b_proj.weight": (8, 4)}
    w = mx.array(np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32))
    split = Split()
    split.load_weights(list(split.sanitize({"layers.0.kv_b_proj.weight": w}).items()))
    layers = attach_lora(split, {}, 2, 6.0, "kv_b_proj", 0, hf_weight_names=hf)
    assert isinstance(layers["layers.0.kv_b_proj"], DeltaLoRA)
    view = LoRAWeights(split)
    assert [s.name for s in view.layout.specs] == [
        "base_model.model.layers.0.kv_b_proj.lora_A.weight",
        "base_model.model.layers.0.kv_b_proj.lora_B.weight"]
    flat = np.random.default_rng(1).standard_normal(view.layout.numel).astype(np.float32)
    view.set(flat)

    plain = nn.Linear(4, 8, bias=False)
    plain.weight = w
    ref = LoRALinear(plain, 2, 6.0)
    ref_view = LoRAWeights({"layers.0.kv_b_proj": ref})
    ref_view.set(flat)
    x = mx.array(np.random.default_rng(2).standard_normal((3, 4)).astype(np.float32))
    np.testing.assert_allclose(np.asarray(split(x)), np.asarray(ref(x)), rtol=1e-5, atol=1e-5)

    def grads(model):
        g = nn.value_and_grad(model, lambda x: (model(x) ** 2).sum())(x)[1]
        return {k.split(".")[-2]: np.asarray(v) for k, v in tree_flatten(g)}

    got, want = grads(split), grads(ref)
    assert sorted(got) == ["lora_A", "lora_B"]
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5)


def test_lora_linear_weight_is_the_base_weight_as_in_peft():
    """Model code that reads (or clips, as gemma3n's AltUp) a linear's ``weight`` sees
    the base weight on both islands; the update is added when the layer is called."""
    mx, nn = _mlx()
    from yeto.mlx.lora import LoRALinear

    base = nn.Linear(3, 2)
    layer = LoRALinear(base, 2, 4.0)
    assert layer.weight is base.weight and layer.bias is base.bias
    layer.weight = mx.clip(layer.weight, -0.01, 0.01)
    assert float(base.weight.max()) <= 0.01 and "weight" not in layer
    assert not hasattr(LoRALinear(nn.Linear(3, 2, bias=False), 2, 4.0), "bias")
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    net = torch.nn.Sequential(torch.nn.Linear(3, 2))
    wrapped = get_peft_model(net, LoraConfig(r=2, lora_alpha=4, target_modules=["0"]))
    layer = wrapped.base_model.model[0]
    assert layer.weight is layer.base_layer.weight
