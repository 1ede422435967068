"""torch vs MLX island parity: LoRA forward, names/shapes/order, loss, AdamW step.

Here: the checks through in-process servers, training or the sim (the others:
tests/unit/test_parity.py)."""


import re

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'yeto[mlx]')")


pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'yeto[mlx]')")


import mlx.nn as mnn  # noqa: E402
import torch  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from yeto.cli.parity import main as check_parity  # noqa: E402
from yeto.data import BatchSampler  # noqa: E402
from yeto.mlx.learner import (  # noqa: E402
    build_lora_model,
    make_loss_and_grad,
    make_optimizer,
)
from yeto.mlx.learner import train_step as mlx_train_step  # noqa: E402
from yeto.mlx.learner import weighted_ce_sum as mlx_ce_sum  # noqa: E402
from yeto.mlx.lora import LoRALinear, LoRAWeights  # noqa: E402
from yeto.testing.tiny import make_tiny_model  # noqa: E402
from yeto.torch.loss import train_step as torch_train_step  # noqa: E402
from yeto.torch.loss import weighted_ce_sum as torch_ce_sum  # noqa: E402
from yeto.torch.model import attach_lora, load_base  # noqa: E402
from yeto.torch.weights import TorchWeights  # noqa: E402

pytestmark = pytest.mark.mlx


@pytest.fixture(scope="session")
def llama_dir(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def pair(llama_dir):
    """The torch island's and the MLX island's LoRA models, holding the same random
    (non-zero) LoRA weights."""
    tm, _ = load_base(str(llama_dir))
    pm = attach_lora(tm, 8, 16.0, "auto", 0)
    tw = TorchWeights(pm, "lora")
    mm, _, layers = build_lora_model(llama_dir, 8, 16.0, "auto", 0)
    mw = LoRAWeights(layers)
    rng = np.random.default_rng(0)
    flat = (rng.standard_normal(tw.layout.numel) * 0.05).astype(np.float32)
    tw.set(flat)
    mw.set(flat)
    return pm, tw, mm, mw


def _batch(seed=1, b=4, t=64, vocab=1024):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (b, t + 1)).astype(np.int32)
    weights = (rng.random((b, t)) > 0.3).astype(np.float32)
    return tokens, weights


# ---- LoRALinear --------------------------------------------------------------
@pytest.mark.parametrize("bias", [False, True])
def test_lora_linear_matches_peft_forward(bias):
    from peft import LoraConfig, get_peft_model

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(48, 40, bias=bias)

        def forward(self, x):
            return self.proj(x)

    torch.manual_seed(0)
    pm = get_peft_model(One(), LoraConfig(r=4, lora_alpha=12, target_modules=["proj"]))
    layer = pm.base_model.model.proj
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0, 0.1)
    base = mnn.Linear(48, 40, bias=bias)
    base.weight = mx.array(layer.base_layer.weight.detach().numpy())
    if bias:
        base.bias = mx.array(layer.base_layer.bias.detach().numpy())
    ml = LoRALinear(base, r=4, alpha=12)
    assert ml.lora_A.weight.shape == (4, 48) and ml.lora_B.weight.shape == (40, 4)
    assert ml.scaling == layer.scaling["default"] == 3.0
    ml.lora_A.weight = mx.array(layer.lora_A["default"].weight.detach().numpy())
    ml.lora_B.weight = mx.array(layer.lora_B["default"].weight.detach().numpy())
    x = np.random.default_rng(0).standard_normal((2, 5, 48)).astype(np.float32)
    want = pm(torch.from_numpy(x)).detach().numpy()
    got = np.array(ml(mx.array(x)))
    assert np.abs(got - want).max() < 1e-5
    # only the LoRA factors train
    assert sorted(k for k, _ in tree_flatten(ml.trainable_parameters())) == [
        "lora_A.weight", "lora_B.weight"]


# ---- names ------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_check_parity_ok(arch, tmp_path_factory, capsys):
    d = make_tiny_model(tmp_path_factory.mktemp(f"names-{arch}"), arch, pretrain=False)
    rc = check_parity(["--model", str(d), "--lora-r", "8"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0, "\n".join(out)
    assert re.fullmatch(r"parity: OK, 28 tensors, max \|dlogit\| \S+", out[-1]), out[-1]
    rc = check_parity(["--model", str(d), "--lora-targets", "attention", "--quiet"])
    assert rc == 0
    assert capsys.readouterr().out.strip().startswith("parity: OK, 16 tensors, max |dlogit| ")


def test_check_parity_names_first_mismatch(llama_dir, capsys):
    rc = check_parity(["--model", str(llama_dir), "--lora-r", "8", "--mlx-lora-r", "4"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 1
    assert last == ("parity: MISMATCH at tensor #0: torch has base_model.model.model.layers.0."
                    "mlp.down_proj.lora_A.weight [8, 256], mlx has base_model.model.model."
                    "layers.0.mlp.down_proj.lora_A.weight [4, 256]")
    rc = check_parity(["--model", str(llama_dir), "--mlx-lora-targets", "q_proj,v_proj",
                       "--quiet"])
    last = capsys.readouterr().out.strip()
    assert rc == 1 and "layers.0.self_attn.q_proj.lora_A.weight" in last


def test_layouts_identical(pair):
    _, tw, _, mw = pair
    assert [(s.name, s.shape) for s in mw.layout.specs] == \
        [(s.name, s.shape) for s in tw.layout.specs]
    assert mw.layout.fingerprint == tw.layout.fingerprint


# ---- loss and optimizer -----------------------------------------------------
def test_logits_and_weighted_loss_match(pair):
    pm, _, mm, _ = pair
    tokens, weights = _batch()
    with torch.no_grad():
        lt = pm(input_ids=torch.from_numpy(tokens[:, :-1]).long()).logits.numpy()
        t = float(torch_ce_sum(pm, torch.from_numpy(tokens), torch.from_numpy(weights)))
    lm = np.array(mm(mx.array(tokens[:, :-1])))
    assert np.abs(lt - lm).max() < 1e-4
    m = float(mlx_ce_sum(mm, mx.array(tokens), mx.array(weights)))
    w = float(weights.sum())
    assert abs(t / w - m / w) <= 1e-4


@pytest.fixture(scope="module")
def task_blocks(llama_dir, tmp_path_factory):
    """Real document-packed blocks of the fixture task (several chats per block)."""
    from transformers import AutoTokenizer

    from yeto.data import load_blocks
    from yeto.testing.tasks import make_task

    train, _ = make_task(tmp_path_factory.mktemp("parity-task"), n_train=200, n_eval=10)
    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    return {p: load_blocks(train, tok, 64, packing=p)[:8] for p in ("document", "naive")}


@pytest.mark.parametrize("packing", ["document", "naive"])
def test_packed_documents_loss_matches(pair, task_blocks, packing):
    """Document packing: torch restarts position ids per document and masks across
    documents; MLX masks only (RoPE is relative) -- the same loss."""
    from yeto.data import is_naive

    pm, _, mm, _ = pair
    b = task_blocks[packing]
    assert is_naive(b.positions) == (packing == "naive")
    with torch.no_grad():
        t = float(torch_ce_sum(pm, torch.from_numpy(b.tokens), torch.from_numpy(b.weights),
                               torch.from_numpy(np.ascontiguousarray(b.positions))))
    m = float(mlx_ce_sum(mm, mx.array(b.tokens), mx.array(b.weights), b.positions))
    w = float(b.weights.sum())
    assert abs(t / w - m / w) <= 1e-4


def test_document_mask_matters(pair, task_blocks):
    """Document-packed blocks: the same tokens under plain causal attention give
    another loss, so the parity above is a parity of the masked forward."""
    _, _, mm, _ = pair
    b = task_blocks["document"]
    w = float(b.weights.sum())
    masked = float(mlx_ce_sum(mm, mx.array(b.tokens), mx.array(b.weights), b.positions))
    plain = float(mlx_ce_sum(mm, mx.array(b.tokens), mx.array(b.weights)))
    assert abs(plain / w - masked / w) > 1e-3


def test_grad_accum_step_and_adamw_match(llama_dir, task_blocks):
    """Same weights + same micro-batches -> same Σw·CE/Σw loss, same gradients, and
    the same weights after AdamW steps (weight decay on)."""
    tm, _ = load_base(str(llama_dir))
    pm = attach_lora(tm, 8, 16.0, "auto", 0)
    tw = TorchWeights(pm, "lora")
    mm, _, layers = build_lora_model(llama_dir, 8, 16.0, "auto", 0)
    mw = LoRAWeights(layers)
    flat = (np.random.default_rng(0).standard_normal(tw.layout.numel) * 0.05).astype(np.float32)
    tw.set(flat)
    mw.set(flat)
    sampler = BatchSampler(task_blocks["document"], 2, seed=0)
    micro = [next(sampler), next(sampler)]  # yeto.data.Batch: tokens, weights, positions
    weights = np.concatenate([mb[1] for mb in micro])

    # gradients of the normalised loss (no optimizer)
    total = float(weights.sum())
    pm.zero_grad()
    for mb in micro:
        loss = torch_ce_sum(pm, torch.from_numpy(mb[0]), torch.from_numpy(mb[1]),
                            torch.from_numpy(mb.positions))
        (loss / total).backward()
    gt = torch.cat([p.grad.reshape(-1) for p in tw._ordered]).numpy()
    lg = make_loss_and_grad(mm)
    gm = None
    for mb in micro:
        _, g = lg(mb[0], mb[1], total, mb.positions)
        g = dict(tree_flatten(g))
        gm = g if gm is None else {k: gm[k] + g[k] for k in g}
    gm = np.concatenate([np.array(gm[s.name[len("base_model.model."):]]).reshape(-1)
                         for s in mw.layout.specs])
    assert np.abs(gt - gm).max() <= 1e-4 * np.abs(gt).max()  # float32 summation order

    # AdamW at the islands' default lr. Adam's first step is lr·g/(|g|+eps): where a
    # gradient entry is float rounding noise (|g| ~ 1e-8, against a median of ~2e-3)
    # the two backends' noise differs and so does that entry's step, by up to 2·lr
    # per step (measured: 1 of 32768 entries, 2.7e-4). Everywhere the gradient is
    # signal (|g| > 1e-5, 10x the gradients' measured disagreement) the weights agree
    # to 1e-5.
    signal = (np.abs(gt) > 1e-5) & (np.abs(gm) > 1e-5)
    assert signal.mean() > 0.99
    opt_t = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-3,
                              weight_decay=0.1)
    opt_m = make_optimizer(1e-3, 0.1)
    for step in range(3):
        lt_, nt = torch_train_step(pm, opt_t, micro, "cpu")
        lm_, nm = mlx_train_step(mm, opt_m, micro, lg)
        assert nt == nm == int(np.count_nonzero(weights))
        assert abs(lt_ - lm_) <= 1e-4
        diff = np.abs(tw.get() - mw.get())
        assert diff[signal].max() <= 1e-5, f"step {step + 1}"
        assert diff.max() <= 2 * 1e-3 * (step + 1), f"step {step + 1}"
    assert np.abs(mw.get() - flat).max() > 1e-5  # the weights did move


# ---- data -------------------------------------------------------------------
def test_islands_train_on_identical_batches(llama_dir, tmp_path, monkeypatch):
    """`python -m yeto.learner` and `python -m yeto.mlx.learner`, given the same data,
    seed and shard, hand their train steps the same micro-batches (tokens, loss
    weights, document positions), step for step: recorded where each backend's
    train step receives them."""
    from yeto.mlx.learner import MLXBackend
    from yeto.mlx.learner import main as mlx_main
    from yeto.testing.tasks import make_task
    from yeto.torch.learner import TorchBackend
    from yeto.torch.learner import main as torch_main

    seen: dict[str, list] = {"torch": [], "mlx": []}
    for backend, cls in (("torch", TorchBackend), ("mlx", MLXBackend)):
        def recording(self, micro, _step=cls.train_step, _log=seen[backend]):
            _log.append([(mb.tokens.copy(), mb.weights.copy(), mb.positions.copy())
                         for mb in micro])
            return _step(self, micro)
        monkeypatch.setattr(cls, "train_step", recording)
    train, _ = make_task(tmp_path / "task", n_train=60, n_eval=4)
    args = ["--model", str(llama_dir), "--data", str(train), "--max-steps", "3",
            "--batch-size", "2", "--grad-accum", "2", "--seq-len", "32", "--lora-r", "2",
            "--seed", "5", "--learner-index", "1", "--num-learners", "2", "--no-progress",
            "--log-level", "WARNING"]
    assert torch_main([*args, "--threads", "1"]) == 0
    assert mlx_main(args) == 0
    assert len(seen["torch"]) == len(seen["mlx"]) == 3
    for step, (t, m) in enumerate(zip(seen["torch"], seen["mlx"]), 1):
        assert len(t) == len(m) == 2, f"step {step}"
        for a, b in zip(t, m):
            assert all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b))
    tokens = [mb[0] for step in seen["torch"] for mb in step]
    assert all(x.shape == (2, 33) for x in tokens)
    assert len({x.tobytes() for x in tokens}) == len(tokens)  # the sampler moves on
    assert any((mb[2][:, 1:] == 0).any() for step in seen["mlx"] for mb in step)  # documents


# ---- the weights view of an mlx-lm model ----------------------------------------
def test_lora_weights_view_of_an_mlx_lm_model(llama_dir):
    """`LoRAWeights(model)` on mlx-lm's own LoRA layers (as `MLXDiLoCo` uses it): peft
    names and shapes, its lora_a/lora_b transposed bit for bit, the dtype kept."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from yeto.mlx.load import load_model

    model, _ = load_model(llama_dir)
    model.freeze()
    linear_to_lora_layers(model, 2, {"rank": 4, "scale": 2.5, "dropout": 0.0,
                                     "keys": ["self_attn.q_proj", "mlp.down_proj"]})
    view = LoRAWeights(model)
    q = model.model.layers[1].self_attn.q_proj
    name = "base_model.model.model.layers.1.self_attn.q_proj.lora_{}.weight"
    assert len(view.layout.specs) == 8
    assert dict((s.name, s.shape) for s in view.layout.specs)[name.format("A")] == (4, 128)
    flat = np.random.default_rng(0).standard_normal(view.layout.numel).astype(np.float32)
    view.set(flat)
    assert np.array_equal(view.get(), flat)
    tensors = view.tensors()
    assert np.array_equal(np.asarray(q.lora_a), tensors[name.format("A")].T)
    assert np.array_equal(np.asarray(q.lora_b), tensors[name.format("B")].T)
    assert view.lora_config() == (4, 2.5, sorted(
        f"model.layers.{i}.{k}" for i in (0, 1) for k in ("mlp.down_proj", "self_attn.q_proj")))
    model.set_dtype(mx.bfloat16)
    half = LoRAWeights(model)
    half.set(flat)
    assert q.lora_a.dtype == mx.bfloat16
    assert np.abs(half.get() - flat).max() <= 0.01 * np.abs(flat).max()
    model.model.layers[0].input_layernorm.unfreeze()  # not a LoRA factor: no adapter config
    mixed = LoRAWeights(model)
    assert "model.layers.0.input_layernorm.weight" in mixed.layout.offsets
    assert mixed.lora_config() is None
