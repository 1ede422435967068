"""LoRA on fused mixture-of-experts weights (issue 32): the torch island (peft's
``target_parameters``) and the MLX island (`yeto.mlx.experts.ExpertLoRA` on mlx-lm's
SwitchLinear) adapt the same expert weights under the same names and compute the same
function; the adapter files load in peft and in mlx-lm. Tiny qwen3_moe and mixtral
models (`yeto.testing.archs`), built once per module."""

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'yeto[mlx]')")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'yeto[mlx]')")

from yeto.interop import parity  # noqa: E402
from yeto.testing import archs  # noqa: E402

pytestmark = pytest.mark.mlx

#: per layer: gate_up_proj and down_proj, lora_A and lora_B each
EXPERT_TENSORS = archs.TINY_LAYERS * 2 * 2


class _Models(dict):
    """The tiny models, each built the first time a test asks for it."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, arch):
        self[arch] = archs.tiny_model(arch, self.root / arch)
        return self[arch]


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    return _Models(tmp_path_factory.mktemp("moe"))


@pytest.mark.parametrize("arch", [
    "qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)])  # the default suite's budget
def test_expert_lora_names_and_logits_agree(moe_models, arch):
    rep = parity.check(moe_models[arch], r=4, alpha=8.0, targets="all-linear")
    assert rep.names_ok, rep.first_mismatch
    assert rep.n_expert_tensors == EXPERT_TENSORS
    assert rep.expert_effect > 0.1  # the expert adapter alone moves the logits ...
    assert rep.logits_ok(), (rep.max_dlogit, rep.expert_dlogit, rep.max_logit)  # ... alike
    names = [r.split()[1] for r in rep.rows[1:]]
    assert "model.layers.0.mlp.experts.base_layer.lora_B.weight" in names  # gate_up_proj
    assert "model.layers.0.mlp.experts.lora_A.weight" in names  # down_proj, peft's nesting
    assert not any(".mlp.gate." in n for n in names)  # the router stays frozen


#: more MoE architectures whose experts transformers fuses and mlx-lm stacks (the
#: deepseek family's router is a weight mlx-lm keeps as a linear: left out too)
MORE = ("deepseek_v3", "glm4_moe", "olmoe", "qwen2_moe", "phimoe", "ernie4_5_moe",
        "qwen3_next", "lfm2_moe", "afmoe")


@pytest.mark.slow
@pytest.mark.parametrize("arch", MORE)
def test_expert_lora_on_more_architectures(arch, tmp_path):
    rep = parity.check(archs.tiny_model(arch, tmp_path / arch), r=4, alpha=8.0,
                       targets="all-linear")
    assert rep.names_ok, rep.first_mismatch
    assert rep.n_expert_tensors > 0 and rep.expert_effect > 0.1
    assert rep.logits_ok(), (rep.max_dlogit, rep.expert_dlogit, rep.max_logit)


def test_experts_entry_alone_and_auto(moe_models):
    d = moe_models["qwen3_moe"]
    only = parity.names(d, r=2, alpha=4.0, targets="experts.down_proj")
    assert only.names_ok and only.n_tensors == only.n_expert_tensors == archs.TINY_LAYERS * 2
    auto = parity.names(d, r=2, alpha=4.0, targets="auto")
    assert auto.names_ok and auto.n_expert_tensors == 0  # auto: attention only on MoE


def _adapted(d, targets="all-linear", seed=3):
    """Both islands' models with the same non-zero adapter, and the torch logits."""
    tm, tw = parity.torch_lora(d, 4, 8.0, targets, meta=False)
    mm, mw = parity.mlx_lora(d, 4, 8.0, targets, lazy=False)
    flat = parity.adapter_vector(tw.layout, seed)
    tw.set(flat)
    mw.set(flat)
    ids = parity.token_ids(256, seed)
    return tm, mm, mw, ids, parity._torch_logits(tm, ids)


def test_mlx_island_adapter_loads_in_peft_and_mlx_lm(moe_models, tmp_path):
    """The MLX island's output (peft adapter + its mlx-lm copy) gives the torch
    island's logits through peft.PeftModel.from_pretrained and mlx-lm's adapter
    loading (LoRASwitchLinear, per expert lora_a (E, r, in), lora_b (E, out, r))."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from yeto.interop.export import load_with_mlx_lm_adapter
    from yeto.mlx.learner import export_files, save_outputs
    from yeto.mlx.lora import adapter_targets, lora_layers

    d = moe_models["qwen3_moe"]
    tm, mm, mw, ids, want = _adapted(d)
    modules, params = adapter_targets({m.hf_path: m for m in lora_layers(mm).values()})
    assert len(params) == 2 * archs.TINY_LAYERS and all(".experts." in p for p in params)
    _, files = export_files(str(d), 4, 8.0, modules, params)
    save_outputs(tmp_path, mw.tensors(), files["adapter_config.json"], d)
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["target_parameters"] == params
    tm.save_pretrained(tmp_path / "torch")  # what peft itself writes for the torch island
    want_cfg = json.loads((tmp_path / "torch" / "adapter_config.json").read_text())
    for c in (cfg, want_cfg):  # peft shortens target_modules to leaf names, in set order
        c.pop("base_model_name_or_path"), c.pop("target_modules")
    assert cfg == want_cfg
    base = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    effect = np.abs(want - parity._torch_logits(base, ids)).max()  # before peft wraps it
    peft_logits = parity._torch_logits(PeftModel.from_pretrained(base, str(tmp_path / "adapter")),
                                       ids)
    assert np.array_equal(peft_logits, want)  # the same tensors into the same peft model
    mlx_cfg = json.loads((tmp_path / "mlx" / "adapter_config.json").read_text())
    assert "mlp.switch_mlp.gate_proj" in mlx_cfg["lora_parameters"]["keys"]
    mlx_model = load_with_mlx_lm_adapter(d, tmp_path / "mlx", plain=False)
    got = parity._mlx_logits(mlx_model, ids)
    assert effect > 0.1 and np.abs(got - want).max() <= parity.REL_TOL * np.abs(want).max()
    # and back: mlx-lm's per-expert factors to peft's, bit for bit, config included
    from safetensors.numpy import load_file

    from yeto.interop.adapters import mlx_to_peft

    mlx_to_peft(tmp_path / "mlx", tmp_path / "back", base_model=d)
    want_t = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    back_t = load_file(str(tmp_path / "back" / "adapter_model.safetensors"))
    assert back_t.keys() == want_t.keys()
    assert all(np.array_equal(back_t[k], want_t[k]) for k in want_t)
    back_cfg = json.loads((tmp_path / "back" / "adapter_config.json").read_text())
    assert back_cfg["target_parameters"] == params
    # plain mlx_lm.load, on a config that says num_experts, head_dim and rope_theta at
    # the top, as Qwen3-MoE checkpoints do (transformers 5 writes them elsewhere)
    import mlx_lm

    plain = tmp_path / "plain"
    shutil.copytree(d, plain)
    config = json.loads((plain / "config.json").read_text())
    config.update(num_experts=4, head_dim=16, rope_theta=config["rope_parameters"]["rope_theta"])
    (plain / "config.json").write_text(json.dumps(config))
    mlx_model, _ = mlx_lm.load(str(plain), adapter_path=str(tmp_path / "mlx"))
    got = parity._mlx_logits(mlx_model, ids)
    assert np.abs(got - want).max() <= parity.REL_TOL * np.abs(want).max()


@pytest.mark.slow  # ~3 s more; qwen3_moe's files are checked by default
def test_torch_adapter_converts_for_mixtral(moe_models, tmp_path):
    """A torch island's adapter (peft's own save_pretrained) on mixtral (mlx-lm's
    block_sparse_moe.switch_mlp; w1/w3 fused into gate_up_proj) converts exactly."""
    from yeto.interop.adapters import peft_to_mlx
    from yeto.interop.export import load_with_mlx_lm_adapter

    d = moe_models["mixtral"]
    tm, _, _, ids, want = _adapted(d, seed=5)
    tm.save_pretrained(tmp_path / "peft")
    peft_to_mlx(tmp_path / "peft", tmp_path / "mlx", base_model=d)
    got = parity._mlx_logits(load_with_mlx_lm_adapter(d, tmp_path / "mlx", plain=False), ids)
    assert np.abs(got - want).max() <= parity.REL_TOL * np.abs(want).max()


def test_frozen_a_on_expert_weights(moe_models):
    """--lora-freeze-a (torch island): expert lora_A (r·E, in) drawn from the seed like
    any other, frozen; only lora_B is trained and synced."""
    import torch
    from transformers import AutoModelForCausalLM

    from yeto import frozen
    from yeto.torch.model import attach_lora, canonical_name

    base = AutoModelForCausalLM.from_pretrained(str(moe_models["qwen3_moe"]), dtype=torch.float32)
    model = attach_lora(base, 4, 8.0, "experts", seed=7, freeze_a=True)
    params = dict(model.named_parameters())
    a_names = [n for n in params if ".experts." in n and ".lora_A." in n]
    assert len(a_names) == 2 * archs.TINY_LAYERS
    for n in a_names:
        p = params[n]
        assert not p.requires_grad and p.shape[0] == 4 * 4  # r x experts
        want = frozen.frozen_lora_a(canonical_name(n, "lora"), tuple(p.shape), 7)
        assert np.array_equal(p.detach().numpy(), want)
    assert all(params[n.replace("lora_A", "lora_B")].requires_grad for n in a_names)
