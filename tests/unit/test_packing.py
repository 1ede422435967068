"""Packing without leaks: document positions, block-diagonal masks, and the torch
island's forward/loss over packed blocks; loss normalisation parity with MLX.

Here: the checks that need no process, server or training (the others:
tests/integration/test_packing.py)."""


import numpy as np
import pytest
import torch

from yeto.data import Blocks, attention_mask, pack_blocks, segment_ids
from yeto.torch.loss import packed_inputs


def _docs(lengths, seed=0, vocab=200):
    rng = np.random.default_rng(seed)
    return [(rng.integers(5, vocab, n).tolist(), [1.0] * n) for n in lengths]


def test_document_packing_positions_and_weights():
    docs = [([1, 2, 3], [1.0] * 3), ([4, 5, 6, 7, 8], [1.0] * 5), ([9, 10, 11, 12], [1.0] * 4)]
    b = pack_blocks(docs, seq_len=4, packing="document")
    # stream 1..12, blocks of 5 with stride 4: inputs [1 2 3 4] [5 6 7 8] [9 10 11 12]
    assert b.tokens.tolist() == [[1, 2, 3, 4, 5], [5, 6, 7, 8, 9], [9, 10, 11, 12, 0]][:len(b)]
    assert b.positions.tolist() == [[0, 1, 2, 0], [0, 1, 2, 3], [0, 1, 2, 3]][:len(b)]
    # targets 4 and 9 start documents: never targets under document packing
    assert b.weights.tolist()[:2] == [[1, 1, 0, 1], [1, 1, 1, 0]]
    naive = pack_blocks(docs, seq_len=4)
    assert naive.weights.all() and (naive.positions == np.arange(4)).all()
    np.testing.assert_array_equal(naive.tokens, b.tokens)


def test_segments_and_mask_are_block_diagonal_causal():
    pos = np.array([[0, 1, 2, 0, 1, 0]], np.int32)
    assert segment_ids(pos).tolist() == [[1, 1, 1, 2, 2, 3]]
    m = attention_mask(pos)[0]
    assert m.dtype == bool and m.shape == (6, 6)
    assert m[2, :3].all() and not m[2, 3:].any()  # doc 1 sees itself, causally
    assert m[4].tolist() == [False, False, False, True, True, False]
    assert m[5].tolist() == [False] * 5 + [True]
    # a block that starts mid-document: its first piece is one segment
    assert attention_mask(np.array([[3, 4, 0]]))[0].tolist() == [
        [True, False, False], [True, True, False], [False, False, True]]


def test_padding_tail_is_its_own_segment():
    b = pack_blocks([([5, 6, 7], [1.0] * 3)], seq_len=6, packing="document")
    assert b.positions.tolist() == [[0, 1, 2, 0, 1, 2]] and b.weights[0].tolist() == [1, 1, 0,
                                                                                        0, 0, 0]


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


def test_plain_blocks_get_plain_inputs(model):
    tokens = torch.zeros(2, 9, dtype=torch.long)
    assert packed_inputs(model, tokens, None).keys() == {"input_ids"}
    assert packed_inputs(model, tokens, torch.arange(8).repeat(2, 1)).keys() == {"input_ids"}
    kw = packed_inputs(model, tokens, torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2))
    assert kw["use_cache"] is False and kw["attention_mask"].shape == (2, 1, 8, 8)
    expect = torch.bool if model.config._attn_implementation == "sdpa" else torch.float32
    assert kw["attention_mask"].dtype == expect


def test_blocks_slice_keeps_positions_for_eval():
    b = pack_blocks(_docs((5, 8, 6, 9)), seq_len=6, packing="document")
    head = b[:2]
    assert isinstance(head, Blocks) and np.array_equal(head.positions, b.positions[:2])
