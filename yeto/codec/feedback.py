"""Error feedback: each encode's quantization residual carried into the next."""

from __future__ import annotations

import numpy as np

from yeto.codec.format import Encoder, Scratch


class ErrorFeedback:
    """Carry each encode's quantization residual into the next encode.

    With it the running sum of decoded pushes equals the running sum of true
    pushes minus the current residual, which is at most half a quantization step:
    nothing is lost over time, however coarse the wire. f32 is exact, so it keeps
    no residual (`residual` is None) unless work is carried back into it (`carry`).
    """

    def __init__(self, numel: int, encoding: str):
        self.encoding, self.numel = encoding, int(numel)
        self.residual: np.ndarray | None = (
            None if encoding == "f32" else np.zeros(self.numel, dtype=np.float32))

    def encode(self, x: np.ndarray, offset: int = 0) -> bytes:
        """Encode x, which covers residual[offset:offset + len(x)] (a fragment)."""
        x = np.array(x, dtype=np.float32).reshape(-1)  # a copy: it becomes the target
        enc = Encoder(self.encoding, x.size)
        self.encode_piece(x, enc, 0, offset)
        self.done()
        return enc.buffer.tobytes()

    def encode_piece(self, x: np.ndarray, enc: Encoder, at: int, offset: int,
                     scratch: Scratch | None = None) -> None:
        """Put x + residual (values [offset, offset + len(x)) of the vector) into `enc`
        at `at`, keeping what the encoding lost as the new residual there. `x` is
        overwritten (it becomes the target); on a CodecError nothing is changed.
        `scratch`: the calling thread's q4 buffers (a piece of at most one q4 chunk
        then stays in the CPU cache from its add to its residual)."""
        r = None if self.residual is None else self.residual[offset:offset + x.size]
        if r is not None:
            np.add(r, x, out=x)
        dec = enc.put(at, x, scratch, decoded=r is not None)
        if r is None:
            return
        if self.encoding == "f32":
            r[...] = 0.0
        else:
            if dec is None:
                dec = enc.decoded(at, at + x.size, scratch)
            np.subtract(x, dec, out=r)

    def done(self) -> None:
        """After a push: an f32 residual (only there after a carry) is freed once every
        fragment has spent its part."""
        if self.encoding == "f32" and self.residual is not None and not self.residual.any():
            self.residual = None

    def carry(self, offset: int, values: np.ndarray) -> None:
        """Add values to the residual at offset: work the syncer did not get goes into
        the next push."""
        if self.residual is None:
            self.residual = np.zeros(self.numel, dtype=np.float32)
        self.residual[offset:offset + values.size] += values
