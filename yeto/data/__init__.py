"""Training data: sources (files, folders, saved datasets, hub ids), row formats,
packing into token blocks with loss weights, and provenance records.

Backend-free (numpy): the torch and MLX islands consume the same `Blocks` and the
same `BatchSampler` batches.
"""

from yeto.data.blocks import (
    PACKING,
    Batch,
    BatchSampler,
    Blocks,
    Rows,
    attention_mask,
    is_naive,
    load_blocks,
    load_rows,
    pack_blocks,
    read_source,
    segment_ids,
    shard_rows,
)
from yeto.data.formats import ACCEPTED_SCHEMAS, FORMATS, DataError, Encoded, encode_row, row_schema

__all__ = [
    "ACCEPTED_SCHEMAS", "FORMATS", "PACKING", "Batch", "BatchSampler", "Blocks", "DataError",
    "Encoded", "Rows", "attention_mask", "encode_row", "is_naive", "load_blocks", "load_rows",
    "pack_blocks", "read_source", "row_schema", "segment_ids", "shard_rows",
]  # fmt: skip
