"""What crosses from the gRPC edge into the run: plain dataclasses, made from the
protobuf messages by `syncer.service` (the run never sees protobuf)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from yeto.proto import yeto_pb2 as pb


@dataclass(frozen=True)
class PushHeader:
    """A push's header: a delta (Δ = anchor − local) for one fragment, or the seed
    (the first island's initial weights, f32, the whole vector)."""

    learner_id: str
    generation: int
    round: int           # the round the island means to join (base_version + 1)
    fragment: int
    base_version: int    # version of the anchor the delta is taken against
    loss_tokens: int     # tokens with non-zero loss weight since the last push
    steps: int           # optimizer steps since the last push
    encoding: str        # f32 | bf16 | q4
    numel: int
    payload_bytes: int
    seed: bool
    seq: int             # per-learner push counter; a repeated seq is a duplicate
    train_loss: float = math.nan  # metrics, NaN when unknown
    eval_loss: float = math.nan

    @classmethod
    def from_pb(cls, h: pb.PushHeader) -> PushHeader:
        """Raises ValueError for a kind that is neither DELTA nor SEED."""
        if h.kind not in (pb.DELTA, pb.SEED):
            raise ValueError(f"unknown push kind {h.kind}")
        return cls(h.learner_id, h.generation, h.round, h.fragment, h.base_version,
                   h.loss_tokens, h.steps, h.encoding, h.numel, h.payload_bytes,
                   h.kind == pb.SEED, h.seq, h.train_loss, h.eval_loss)
