"""Training data: sources (files, folders, saved datasets, hub ids: `sources`), row
formats (`formats`), packing into token blocks with loss weights and the seeded
batches (`packing`), provenance records (`provenance`) and models pinned and checked
before they load (`models`).

Backend-free (numpy): the torch and MLX islands consume the same `Blocks` and the
same `BatchSampler` batches.
"""

from yeto.data.formats import ACCEPTED_SCHEMAS, FORMATS, DataError, Encoded, encode_row, row_schema
from yeto.data.packing import (
    PACKING,
    Batch,
    BatchSampler,
    Blocks,
    attention_mask,
    is_naive,
    load_blocks,
    pack_blocks,
    segment_ids,
)
from yeto.data.sources import Rows, load_rows, read_source, shard_rows

__all__ = [
    "ACCEPTED_SCHEMAS", "FORMATS", "PACKING", "Batch", "BatchSampler", "Blocks", "DataError",
    "Encoded", "Rows", "attention_mask", "encode_row", "is_naive", "load_blocks", "load_rows",
    "pack_blocks", "read_source", "row_schema", "segment_ids", "shard_rows",
]  # fmt: skip
