"""What the document-packing tests on models with layers of several kinds share
(tests/integration/test_packing_layer_kinds.py, tests/integration/test_packing_islands.py)."""

import numpy as np
import torch

from yeto.data import pack_blocks

# Llama 4 with 3 layers, the middle one global without RoPE, chunks of 4 tokens
# (tests/e2e/test_arch_parity.py's plan, with floor_scale left at 8192: both islands
# scale the NoPE layer's queries by the token's place in the block, not in its document,
# which changes nothing in blocks shorter than floor_scale)
LLAMA4 = {"text_config": {"num_hidden_layers": 3, "no_rope_layers": [1, 0, 1],
                          "layer_types": ["chunked_attention", "full_attention",
                                          "chunked_attention"],
                          "attention_chunk_size": 4, "moe_layers": [1]}}
LENGTHS = (6, 9, 7)  # each longer than 4; the 2nd and 3rd start off a chunk boundary


def packed_block(lengths=LENGTHS):
    """(documents, tokens (1, T+1), positions (1, T)) for one block packing ``lengths``."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(5, 200, n).tolist() for n in lengths]
    b = pack_blocks([(d, [1.0] * len(d)) for d in docs], seq_len=sum(lengths) - 1,
                    packing="document")
    assert len(b) == 1
    return docs, torch.from_numpy(b.tokens), torch.from_numpy(b.positions)


def per_document(logits, docs):
    """(ids, n, rows) for each document in one block's logits (T, vocab); the last
    document loses its final token to the shift."""
    start, out = 0, []
    for ids in docs:
        n = min(len(ids), logits.shape[0] - start)
        out.append((ids, n, logits[start:start + n]))
        start += len(ids)
    return out
