"""The torch and the MLX island on one document-packed block of a model with chunked
attention (Llama 4, chunks of 4 tokens): the same logits for every document
(issue 32). The torch side: tests/integration/test_packing_layer_kinds.py."""

import numpy as np
import pytest
import torch
from helpers.packing import LLAMA4, packed_block, per_document

from yeto.testing import archs
from yeto.torch.loss import packed_inputs

pytestmark = pytest.mark.mlx


def test_islands_agree_on_a_packed_block_with_chunks(tmp_path):
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed")
    from transformers import AutoModelForCausalLM

    from yeto.data import attention_mask
    from yeto.mlx.learner import logits_of
    from yeto.mlx.load import load_model

    path = archs.tiny_model("llama4", tmp_path / "m", overrides=LLAMA4)
    torch_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    mlx_model, _ = load_model(path)
    docs, tokens, positions = packed_block()
    with torch.no_grad():
        t = torch_model(**packed_inputs(torch_model, tokens, positions)).logits[0].numpy()
    mask = mx.array(attention_mask(positions.numpy()))[:, None]
    m = np.array(logits_of(mlx_model, mx.array(tokens[:, :-1].numpy()), mask))[0]
    scale = float(np.abs(t).max())
    for (ids, _n, rows_t), (_, _, rows_m) in zip(per_document(t, docs), per_document(m, docs)):
        assert np.abs(rows_t - rows_m).max() <= 1e-4 * scale, f"document of {len(ids)}"
