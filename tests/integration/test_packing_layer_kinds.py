"""Document packing on models whose layers see less than the block: Llama 4's chunked
attention and sliding windows kept in an image-text model's text config (issue 32).
A 4D mask would be used as-is by every layer and drop the chunks or the window; the
torch island gives such models position ids (yeto.torch.loss.packed_inputs), and each
packed document's logits are those of the document alone.

The other packing checks: tests/integration/test_packing.py, tests/unit/test_packing.py."""

import pytest
import torch
from helpers.packing import LLAMA4, packed_block, per_document

from yeto.data import attention_mask
from yeto.testing import archs
from yeto.torch.loss import packed_inputs

# gemma3 (Gemma3ForConditionalGeneration: sliding_window only in its text config)
GEMMA3 = {"text_config": {"sliding_window": 4}}


def _model(arch: str, overrides: dict, impl: str):
    from transformers import AutoModelForCausalLM

    cfg = archs.tiny_config(arch, overrides)
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    assert m.config._attn_implementation == impl
    return m


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("arch,overrides", [("llama4", LLAMA4), ("gemma3", GEMMA3)])
@torch.no_grad()
def test_packed_documents_equal_the_documents_alone(arch, overrides, impl):
    m = _model(arch, overrides, impl)
    docs, tokens, positions = packed_block()
    kw = packed_inputs(m, tokens, positions)
    assert "attention_mask" not in kw and kw["use_cache"] is False
    packed = m(**kw).logits[0]
    # what a single block-diagonal 4D mask for every layer computes: no chunks, no window
    allowed = torch.from_numpy(attention_mask(positions.numpy()))[:, None]
    one_mask = m(input_ids=tokens[:, :-1], position_ids=positions.long(), use_cache=False,
                 attention_mask=allowed if impl == "sdpa" else
                 torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
                 ).logits[0]
    for (ids, n, rows), (_, _, rows_one) in zip(per_document(packed, docs),
                                                 per_document(one_mask, docs)):
        alone = m(input_ids=torch.tensor([ids])).logits[0, :n]
        assert (rows - alone).abs().max() <= 1e-5 * max(1.0, float(alone.abs().max()))
        # the chunks / the window change these logits: the check above has teeth
        assert (rows_one - alone).abs().max() > 1e-2 * float(alone.abs().max())


@torch.no_grad()
def test_a_block_within_one_chunk_keeps_the_4d_mask():
    """Chunks no shorter than the block are no limit: the explicit mask, exact too."""
    m = _model("llama4", LLAMA4, "sdpa")
    docs, tokens, positions = packed_block((2, 3))
    kw = packed_inputs(m, tokens, positions)
    assert kw["attention_mask"].shape == (1, 1, 4, 4)
    for ids, n, rows in per_document(m(**kw).logits[0], docs):
        assert (rows - m(input_ids=torch.tensor([ids])).logits[0, :n]).abs().max() <= 1e-5
