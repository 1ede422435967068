"""Chunked codec work for the syncer: nothing here holds more than one chunk of
decoded values, whatever the size of the vector.

- `chunk_payload`: the encoded bytes of elements [lo, hi) of a payload (q4: the
  block scales and codes of those blocks; f32/bf16: a zero-copy slice), so that
  `yeto.codec` decodes or encodes a chunk exactly as it would the whole vector
  (q4 blocks are independent; chunk bounds are multiples of `codec.Q4_BLOCK`).
- `decode_add_norm`: acc += w * decode(payload), and the payload's L2 norm, in one
  pass (RDA needs each push's norm); `norm`: the norm alone (clipping).
- `encode_diff`: encode(a - b) chunk by chunk into one output buffer, and b += the
  decoded update, in place (the compressed downlink).
- `PayloadReceiver`: assembles a push from its gRPC chunks into one buffer of the
  wire size, validating as bytes arrive (q4 scales as soon as they are in, f32/bf16
  values as they come), so a bad push is refused before it is held whole.

Norms are summed in float64 over fixed chunks of `CHUNK` elements at absolute
offsets, so any caller gets the same bits for the same payload.

These functions only compose `yeto.codec`'s encoders and decoders; `chunk_payload`,
`encode_diff` and `PayloadReceiver` would sit well in `yeto/codec.py` too.
"""

from __future__ import annotations

import numpy as np

from yeto import codec

CHUNK = 1 << 17  # elements per chunk: a multiple of codec.Q4_BLOCK (as codec's own)
_ITEM = {"f32": 4, "bf16": 2}


def chunks(numel: int, step: int = CHUNK):
    """(lo, hi) element ranges covering [0, numel) at absolute multiples of `step`."""
    for lo in range(0, numel, step):
        yield lo, min(lo + step, numel)


def chunk_payload(buf, encoding: str, numel: int, lo: int, hi: int):
    """The encoded bytes of elements [lo, hi) (lo a multiple of codec.Q4_BLOCK)."""
    mv = memoryview(buf).cast("B")
    if encoding in _ITEM:
        k = _ITEM[encoding]
        return mv[k * lo:k * hi]
    if encoding != "q4":
        raise codec.CodecError(f"unknown encoding {encoding!r}")
    nb = -(-numel // codec.Q4_BLOCK)
    b0, b1 = lo // codec.Q4_BLOCK, -(-hi // codec.Q4_BLOCK)
    half = codec.Q4_BLOCK // 2
    return b"".join((mv[4 * b0:4 * b1], mv[4 * nb + half * b0:4 * nb + half * b1]))


def _checked(payload, encoding: str, numel: int) -> memoryview:
    mv = memoryview(payload).cast("B")
    want = codec.encoded_size(encoding, numel)
    if len(mv) != want:
        raise codec.CodecError(f"{encoding} payload for {numel} elements must be {want} "
                               f"bytes, got {len(mv)}")
    return mv


def decode_add_norm(payload, encoding: str, numel: int, acc: np.ndarray | None,
                    weight: float) -> float:
    """acc += weight * decode(payload) (the same bits as `codec.decode_add`), and the
    L2 norm of decode(payload). With acc None only the norm is computed. Validate
    first (`codec.validate`): a bad chunk found midway would leave acc half-added."""
    mv = _checked(payload, encoding, numel)
    w32 = np.float32(weight)
    total = 0.0
    for lo, hi in chunks(numel):
        v = codec.decode(chunk_payload(mv, encoding, numel, lo, hi), encoding, hi - lo)
        v64 = v.astype(np.float64)
        total += float(np.dot(v64, v64))
        if acc is not None:
            v *= w32
            acc[lo:hi] += v
    return float(np.sqrt(total))


def norm(payload, encoding: str, numel: int) -> float:
    """L2 norm of decode(payload), one chunk at a time."""
    return decode_add_norm(payload, encoding, numel, None, 0.0)


def encode_diff(a: np.ndarray, b: np.ndarray, encoding: str) -> np.ndarray:
    """Return encode(a - b) as a uint8 array (the same bytes as `codec.encode`) and
    add its decoded value to b in place: afterwards b holds exactly what a receiver
    holding the old b gets by adding the payload. One chunk of scratch."""
    numel = a.size
    out = np.empty(codec.encoded_size(encoding, numel), np.uint8)
    diff = np.empty(min(CHUNK, max(numel, 1)), np.float32)
    for lo, hi in chunks(numel):
        d = diff[:hi - lo]
        np.subtract(a[lo:hi], b[lo:hi], out=d)
        piece = codec.encode(d, encoding)
        _place(out, encoding, numel, lo, hi, piece)
        codec.decode_add(piece, encoding, hi - lo, b[lo:hi], 1.0)
    return out


def _place(out: np.ndarray, encoding: str, numel: int, lo: int, hi: int, piece: bytes) -> None:
    """Write the encoding of elements [lo, hi) into its place in the whole payload."""
    src = np.frombuffer(piece, np.uint8)
    if encoding in _ITEM:
        k = _ITEM[encoding]
        out[k * lo:k * hi] = src
        return
    nb = -(-numel // codec.Q4_BLOCK)
    b0, b1 = lo // codec.Q4_BLOCK, -(-hi // codec.Q4_BLOCK)
    half = codec.Q4_BLOCK // 2
    out[4 * b0:4 * b1] = src[:4 * (b1 - b0)]
    out[4 * nb + half * b0:4 * nb + half * b1] = src[4 * (b1 - b0):]


class PayloadReceiver:
    """Assembles one payload of `encoding`/`numel` from byte pieces into `into` (a
    uint8 array of the wire size; a new one by default), validating on arrival:
    q4 block scales once they are all in (they lead the payload), f32/bf16 values
    up to the last whole element received. `add` raises `codec.CodecError` on the
    first bad byte and `ValueError` on a payload longer than announced; `finish`
    raises `ValueError` on a short one and returns the buffer."""

    def __init__(self, encoding: str, numel: int, into: np.ndarray | None = None):
        self.encoding, self.numel = encoding, numel
        self.size = codec.encoded_size(encoding, numel)
        self.buf = np.empty(self.size, np.uint8) if into is None else into
        if self.buf.size != self.size:
            raise ValueError(f"buffer of {self.buf.size} bytes for a {self.size}-byte payload")
        self.n = 0           # bytes received
        self.checked = 0     # bytes validated
        nb = -(-numel // codec.Q4_BLOCK)
        self._scales_end = 4 * nb if encoding == "q4" else 0

    def add(self, piece) -> None:
        k = len(piece)
        if self.n + k > self.size:
            raise ValueError(f"payload exceeds the {self.size} bytes its header announced")
        self.buf[self.n:self.n + k] = np.frombuffer(piece, np.uint8)
        self.n += k
        self._validate()

    def _validate(self) -> None:
        if self.encoding == "q4":
            if self.checked < self._scales_end <= self.n:
                codec.validate(self.buf, "q4", self.numel)  # the scales only
                self.checked = self.size
            return
        k = _ITEM[self.encoding]
        upto = self.n - self.n % k
        if upto > self.checked:
            lo, hi = self.checked // k, upto // k
            codec.validate(self.buf[self.checked:upto], self.encoding, hi - lo)
            self.checked = upto

    def finish(self) -> np.ndarray:
        if self.n != self.size:
            raise ValueError(f"payload ended after {self.n} of {self.size} bytes")
        if self.encoding == "q4" and self.checked < self.size:
            codec.validate(self.buf, "q4", self.numel)
        return self.buf
