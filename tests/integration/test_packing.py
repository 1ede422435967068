"""Packing without leaks: document positions, block-diagonal masks, and the torch
island's forward/loss over packed blocks; loss normalisation parity with MLX.

Here: the checks through in-process servers, training or the sim (the others:
tests/unit/test_packing.py)."""


from types import SimpleNamespace

import numpy as np
import pytest
import torch

from yeto.data import Batch, BatchSampler, pack_blocks
from yeto.torch.loss import evaluate, packed_inputs, train_step, weighted_ce_sum


def _docs(lengths, seed=0, vocab=200):
    rng = np.random.default_rng(seed)
    return [(rng.integers(5, vocab, n).tolist(), [1.0] * n) for n in lengths]


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        attn_implementation=request.param)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    assert m.config._attn_implementation == request.param
    return m


def _packed(lengths):
    docs = _docs(lengths)
    b = pack_blocks(docs, seq_len=sum(lengths) - 1, packing="document")
    assert len(b) == 1
    return docs, b


@torch.no_grad()
def test_document_logits_equal_the_document_alone(model):
    lengths = (7, 11, 5)
    docs, b = _packed(lengths)
    tokens, positions = torch.from_numpy(b.tokens), torch.from_numpy(b.positions)
    logits = model(**packed_inputs(model, tokens, positions)).logits[0]
    naive = model(input_ids=tokens[:, :-1]).logits[0]
    start, naive_diff = 0, []
    for ids, _ in docs:
        n = len(ids) - (1 if start + len(ids) > tokens.shape[1] - 1 else 0)
        alone = model(input_ids=torch.tensor([ids])).logits[0, :n]
        assert (logits[start:start + n] - alone).abs().max() <= 1e-4
        naive_diff.append(float((naive[start:start + n] - alone).abs().max()))
        start += len(ids)
    # naive packing: the first document is alone anyway; the earlier documents leak
    # into every later one
    assert naive_diff[0] <= 1e-4 and min(naive_diff[1:]) > 1e-2


@torch.no_grad()
def test_packed_loss_is_the_sum_of_the_documents_alone(model):
    docs, b = _packed((9, 6, 12))
    packed = weighted_ce_sum(model, torch.from_numpy(b.tokens), torch.from_numpy(b.weights),
                             torch.from_numpy(b.positions))
    alone = sum(weighted_ce_sum(model, torch.tensor([ids]), torch.ones(1, len(ids) - 1))
                for ids, _ in docs)
    assert abs(float(packed) - float(alone)) <= 1e-4 * float(alone)
    assert b.loss_tokens == sum(len(ids) - 1 for ids, _ in docs)
    # evaluate() uses the blocks' positions: mean CE equals the documents' own
    assert abs(evaluate(model, b, 4, "cpu") - float(alone) / b.loss_tokens) <= 1e-5


def test_train_step_takes_batches_and_plain_pairs(model):
    blocks = pack_blocks(_docs((5, 8, 6, 9, 7, 4, 10)), seq_len=12, packing="document")
    s = BatchSampler(blocks, 2, seed=0)
    micro = [next(s), next(s)]
    assert isinstance(micro[0], Batch)
    with torch.no_grad():
        expect = sum(float(weighted_ce_sum(model, torch.from_numpy(t), torch.from_numpy(w),
                                           torch.from_numpy(mb.positions)))
                     for mb in micro for t, w in [mb]) / sum(float(mb[1].sum()) for mb in micro)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    loss, n = train_step(model, opt, micro, "cpu")
    assert abs(loss - expect) <= 1e-5 and n == sum(int(np.count_nonzero(mb[1])) for mb in micro)
    loss2, _ = train_step(model, opt, [tuple(micro[0]), tuple(micro[1])], "cpu")  # naive
    assert abs(loss2 - loss) > 1e-4  # plain pairs carry no document structure


def test_loss_normalisation_matches_mlx():
    """Same logits -> the same Σw·CE / Σw in the torch and the MLX island."""
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed")
    mlx_island = pytest.importorskip("yeto.mlx.learner")
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((3, 16, 50)) * 3).astype(np.float32)
    tokens = rng.integers(0, 50, (3, 17)).astype(np.int32)
    weights = (rng.random((3, 16)) > 0.4).astype(np.float32)
    weights[1] *= 0.5

    class FakeTorch:
        config = SimpleNamespace(_attn_implementation="sdpa")

        def __call__(self, **kw):
            assert kw["input_ids"].shape == (3, 16)
            return SimpleNamespace(logits=torch.from_numpy(logits))

    t = float(weighted_ce_sum(FakeTorch(), torch.from_numpy(tokens), torch.from_numpy(weights)))
    m = float(mlx_island.weighted_ce_sum(lambda x: mx.array(logits), mx.array(tokens),
                                         mx.array(weights)))
    total = float(weights.sum())
    assert abs(t / total - m / total) <= 1e-5
    ref = -np.log(np.take_along_axis(
        np.exp(logits - logits.max(-1, keepdims=True))
        / np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True),
        tokens[:, 1:, None].astype(np.int64), -1)[..., 0])
    assert abs(t / total - float((ref * weights).sum()) / total) <= 1e-5


@torch.no_grad()
def test_position_ids_path_also_isolates_documents(model):
    """Flash/flex attention and sliding-window models get position ids without a 4D
    mask; transformers then splits the packed documents itself."""
    docs, b = _packed((6, 10, 5))
    tokens, positions = torch.from_numpy(b.tokens), torch.from_numpy(b.positions)
    model.config.sliding_window = 4  # shorter than the block: no 4D mask
    try:
        kw = packed_inputs(model, tokens, positions)
        assert "attention_mask" not in kw and kw["use_cache"] is False
        logits = model(**kw).logits[0]
    finally:
        del model.config.sliding_window
    alone = model(input_ids=torch.tensor([docs[1][0]])).logits[0]
    assert (logits[6:16] - alone).abs().max() <= 1e-4
