"""Wire encodings for flat float32 vectors: f32, bf16 and q4.

All encoders refuse non-finite input; all decoders check payload sizes (and q4
scales) so a malformed payload is an error, never garbage in the weights.

q4 format (little-endian), for a vector of n float32 values:

    n is padded with zeros to a multiple of Q4_BLOCK (64); nb = ceil(n / 64) blocks.
    payload = scales || codes
      scales: nb float32, scale_b = max(|x| in block b) / 7
      codes:  nb * 32 bytes; element i of block b has the 4-bit code
              c = clip(round_half_even(x / scale_b), -7, 7) + 8   (1..15; 8 when scale_b == 0)
              and byte j of the block holds elements 2j (low nibble) and 2j+1 (high nibble).
    decode: x = (c - 8) * scale_b
    error bound: |x - decode(encode(x))| <= scale_b / 2 = max|block| / 14 per element.

Size: 0.5625 bytes per element (4 bytes of scale per 64 elements, plus a nibble each).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TypeAlias

import numpy as np

ENCODINGS = ("f32", "bf16", "q4")
Q4_BLOCK = 64
_Q4_LEVELS = 7
# Chunking keeps each numpy pass inside the CPU cache: several passes over a 128K
# chunk (512 KiB of f32 per scratch buffer) beat the same passes over a large array,
# and the chunk is large enough that numpy's per-call overhead stays small
# (BENCHMARKS.md, "Spine, island and fault benchmarks": scripts/bench_codec.py).
CHUNK = 1 << 17  # elements, a multiple of Q4_BLOCK
# x + 1.5 * 2**23 is rounded to an integer by float addition itself (half to even);
# the extra 8 makes the low mantissa byte the 4-bit code
_Q4_MAGIC = np.float32(1.5 * 2**23 + 8)


class CodecError(ValueError):
    """A payload or input that cannot be encoded or decoded."""


# what a payload may arrive as: any contiguous bytes (an array's are its `.data`)
Payload: TypeAlias = bytes | bytearray | memoryview | np.ndarray


def as_view(payload: Payload) -> memoryview:
    """`memoryview(payload)`; an array's is its `.data` (the same view: numpy's stubs
    give arrays the buffer protocol only from Python 3.12)."""
    return payload.data if isinstance(payload, np.ndarray) else memoryview(payload)


def encoded_size(encoding: str, numel: int) -> int:
    if encoding == "f32":
        return 4 * numel
    if encoding == "bf16":
        return 2 * numel
    if encoding == "q4":
        nb = -(-numel // Q4_BLOCK)
        return 4 * nb + nb * Q4_BLOCK // 2
    raise CodecError(f"unknown encoding {encoding!r}; use one of {', '.join(ENCODINGS)}")


def encode(x: np.ndarray, encoding: str) -> bytes:
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if encoding == "f32":
        _check_finite(x)
        return x.tobytes()
    if encoding == "bf16":
        _check_finite(x)
        u = x.view(np.uint32)
        # round to nearest even on the 16 dropped bits
        rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
        return rounded.astype(np.uint16).tobytes()
    if encoding == "q4":
        return _q4_encode(x)
    raise CodecError(f"unknown encoding {encoding!r}; use one of {', '.join(ENCODINGS)}")


def decode(payload: Payload, encoding: str, numel: int) -> np.ndarray:
    """Decode to a new float32 vector of `numel` elements."""
    out = np.empty(numel, dtype=np.float32)
    _decode_into(payload, encoding, numel, out, weight=None)
    return out


def decode_add(payload: Payload, encoding: str, numel: int, acc: np.ndarray, weight: float,
               assign: bool = False) -> None:
    """acc += weight * decode(payload), chunk by chunk: no full-size temporary.
    `assign`: acc = weight * decode(payload), the bits of adding into zeros, without
    reading acc (a reused buffer starting a new sum need not be zeroed first)."""
    _decode_into(payload, encoding, numel, acc, weight=float(weight), assign=assign)


def validate(payload: Payload, encoding: str, numel: int, max_abs: float | None = None) -> None:
    """Check size and finiteness without decoding into anything; with `max_abs`, also
    that every value decodes to at most `max_abs` in magnitude."""
    buf = _sized(payload, encoding, numel)
    if encoding == "q4":
        validate_q4_scales(buf[:4 * -(-numel // Q4_BLOCK)], max_abs)
        return
    for lo in range(0, numel, CHUNK):
        _check_values(_plain_chunk(buf, encoding, lo, min(lo + CHUNK, numel)), encoding,
                      max_abs)


def _check_values(x: np.ndarray, encoding: str, max_abs: float | None) -> None:
    if max_abs is None:
        if not np.isfinite(x).all():
            raise CodecError(f"{encoding} payload holds non-finite values")
        return
    if not (np.abs(x) <= max_abs).all():  # NaN fails the comparison too
        bad = np.abs(x[~(np.abs(x) <= max_abs)][0])
        raise CodecError(f"{encoding} payload holds a value of magnitude {bad:g} "
                         f"(non-finite, or beyond the bound {max_abs:g})")


def _sized(payload: Payload, encoding: str, numel: int) -> memoryview:
    buf = as_view(payload).cast("B")
    want = encoded_size(encoding, numel)
    if len(buf) != want:
        raise CodecError(f"{encoding} payload for {numel} elements must be {want} bytes, "
                         f"got {len(buf)}")
    return buf


def _plain_chunk(buf: memoryview, encoding: str, lo: int, hi: int) -> np.ndarray:
    if encoding == "f32":
        return np.frombuffer(buf, dtype=np.float32, count=hi - lo, offset=4 * lo)
    raw = np.frombuffer(buf, dtype=np.uint16, count=hi - lo, offset=2 * lo)
    return (raw.astype(np.uint32) << 16).view(np.float32)


def _decode_into(payload: Payload, encoding: str, numel: int, out: np.ndarray,
                 weight: float | None, assign: bool = False) -> None:
    buf = _sized(payload, encoding, numel)
    if encoding == "q4":
        _q4_decode(buf, numel, out, weight, assign)
        return
    w32 = np.float32(0.0 if weight is None else weight)  # read only with a weight
    with _scratch_for(None) as k:
        for lo in range(0, numel, k.chunk):
            hi = min(lo + k.chunk, numel)
            chunk = _plain_chunk(buf, encoding, lo, hi)
            if not np.isfinite(chunk).all():
                raise CodecError(f"{encoding} payload holds non-finite values")
            if weight is None:
                out[lo:hi] = chunk
            else:  # out += weight * chunk, the product rounded to f32 first
                add_to(out[lo:hi], np.multiply(chunk, w32, out=k.work[:hi - lo]), assign)


def _check_finite(x: np.ndarray) -> None:
    if not np.isfinite(x).all():
        bad = int(np.flatnonzero(~np.isfinite(x))[0])
        raise CodecError(f"refusing to encode non-finite value {x[bad]} at element {bad}")


def _q4_encode(x: np.ndarray) -> bytes:
    nb = -(-x.size // Q4_BLOCK)
    out = np.empty(4 * nb + nb * Q4_BLOCK // 2, dtype=np.uint8)
    _q4_encode_into(x, out[:4 * nb].view(np.float32), out[4 * nb:])
    return out.tobytes()


class Scratch:
    """The buffers of one q4 chunk (`CHUNK` values), made once and reused by every
    chunk a thread encodes or decodes: a fresh buffer costs page faults, and a reused
    one stays in the CPU cache."""

    def __init__(self, chunk: int = CHUNK):
        self.chunk = chunk = -(-chunk // Q4_BLOCK) * Q4_BLOCK  # whole blocks
        self.work = np.empty(chunk, dtype=np.float32)   # |x|, x / scale + magic; values
        self.wide = np.empty(chunk, dtype=np.float32)   # a block's scale (or 1 / scale) per value
        self.nib = np.empty(chunk, dtype=np.uint8)      # one code per value
        self.pair = np.empty(chunk // 2, dtype="<u2")   # the codes of two values
        self.tmp = np.empty(chunk // 2, dtype="<u2")
        self.starts = np.arange(0, chunk, Q4_BLOCK)


_SPARE: list[Scratch] = []  # scratches any thread may take (list pop/append are atomic)
_SPARE_MAX = 8  # kept at most: one per thread coding at once


@contextlib.contextmanager
def _scratch_for(scratch: Scratch | None) -> Iterator[Scratch]:
    """`scratch`, or one of the spares (made on first need, kept after use): a scratch
    made per call costs its page faults each time, more than the decode of its chunk
    (BENCHMARKS.md, "A half-billion-parameter full-weight round"), and the syncer
    decodes a push a chunk per call."""
    if scratch is not None:
        yield scratch
        return
    try:
        k = _SPARE.pop()
    except IndexError:
        k = Scratch()
    try:
        yield k
    finally:
        if len(_SPARE) < _SPARE_MAX:
            _SPARE.append(k)


def spare_scratch() -> contextlib.AbstractContextManager[Scratch]:
    """A chunk's buffers for the caller's own arithmetic, taken from the spares (and
    given back) for the length of a `with`."""
    return _scratch_for(None)


def _q4_encode_into(x: np.ndarray, scales: np.ndarray, codes: np.ndarray,
                    scratch: Scratch | None = None, decoded: bool = False) -> np.ndarray | None:
    """Encode x into its blocks' `scales` (float32) and `codes` (uint8, 32 per block):
    views into a payload, so a vector encoded piece by piece (pieces starting on block
    boundaries) gives the same bytes as encoded whole. `decoded` (with `scratch`, x of
    at most one chunk): returns decode(codes) too, in the scratch, for three cheap
    passes instead of a decode's seven (the encode's arithmetic holds code - 8 as a
    float already)."""
    out = None
    n = x.size
    nb = -(-n // Q4_BLOCK)
    # non-finite input is detected once, from the block maxima, after the loop
    with _scratch_for(scratch) as s, np.errstate(invalid="ignore", over="ignore",
                                                 divide="ignore"):
        for lo in range(0, nb * Q4_BLOCK, s.chunk):
            hi = min(lo + s.chunk, nb * Q4_BLOCK)
            src = x[lo:hi]
            if hi > n:  # zero padding of the last block
                src = np.zeros(hi - lo, dtype=np.float32)
                src[:n - lo] = x[lo:]
            b0, b1 = lo // Q4_BLOCK, hi // Q4_BLOCK
            out = _q4_encode_chunk(src, scales[b0:b1], codes[lo // 2:hi // 2], s,
                                   decoded and scratch is not None and hi - lo == nb * Q4_BLOCK)
    if not np.isfinite(scales[:nb]).all():  # a NaN/inf in a block shows in its max
        _check_finite(x)
    return out


def _q4_encode_chunk(src: np.ndarray, s: np.ndarray, codes: np.ndarray, k: Scratch,
                     decoded: bool = False) -> np.ndarray | None:
    """One chunk of whole blocks into its scales `s` and `codes`; `decoded`: returns
    their decoded values too (in `k.work`, the bits of `_q4_decode_chunk`)."""
    m = src.size
    w = k.work[:m]
    np.abs(src, out=w)
    # max |x| per block: a non-negative float orders like its bits as int32,
    # and an integer reduceat is much faster than a float max along rows
    np.maximum.reduceat(w.view(np.int32), k.starts[:m // Q4_BLOCK], out=s.view(np.int32))
    s /= _Q4_LEVELS
    inv = np.divide(1.0, s, out=np.zeros_like(s), where=s > 0)
    k.wide[:m].reshape(-1, Q4_BLOCK)[...] = inv[:, None]
    np.multiply(src, k.wide[:m], out=w)
    # + 1.5 * 2**23 rounds half to even to an integer (exactly as rint does)
    # and leaves code = round(x / scale) + 8 in the low byte of the float
    w += _Q4_MAGIC
    c = k.nib[:m]
    np.copyto(c, w.view(np.uint32), casting="unsafe")  # keeps the low byte
    # codes of elements 2j, 2j+1 as one little-endian uint16 -> one byte
    cp = c.view("<u2")
    p = k.pair[:m // 2]
    np.right_shift(cp, 4, out=p)
    p |= cp
    np.copyto(codes, p, casting="unsafe")
    if not decoded or not np.isfinite(inv).all():  # 1 / a tiny scale overflows: decode
        return None
    w -= _Q4_MAGIC  # exactly round(x / scale), the float of code - 8 that decoding makes
    return times_scales(w, s, k, w)


def _q4_decode(buf: memoryview, numel: int, out: np.ndarray, weight: float | None,
               assign: bool = False) -> None:
    nb = -(-numel // Q4_BLOCK)
    _q4_decode_parts(_q4_scales(buf, numel), np.frombuffer(buf, dtype=np.uint8, offset=4 * nb),
                     numel, out, weight, assign=assign)


def _q4_decode_parts(scales: np.ndarray, codes: np.ndarray, numel: int, out: np.ndarray,
                     weight: float | None, scratch: Scratch | None = None,
                     assign: bool = False) -> None:
    """Decode `numel` values from their blocks' scales and codes into `out` (or add
    weight * them: `add_to`)."""
    nb = -(-numel // Q4_BLOCK)
    w32 = None if weight is None else np.float32(weight)
    with _scratch_for(scratch) as k:
        for lo in range(0, nb * Q4_BLOCK, k.chunk):
            hi = min(lo + k.chunk, nb * Q4_BLOCK)
            part = scales[lo // Q4_BLOCK:hi // Q4_BLOCK], codes[lo // 2:hi // 2], k
            valid = min(hi, numel) - lo
            if weight is None and valid == hi - lo:
                _q4_decode_chunk(*part, out=out[lo:hi])
                continue
            v = _q4_decode_chunk(*part)
            if weight is None:
                out[lo:lo + valid] = v[:valid]
            else:
                v *= w32
                add_to(out[lo:lo + valid], v[:valid], assign)


_ZERO = np.float32(0.0)


def add_to(out: np.ndarray, v: np.ndarray, assign: bool) -> None:
    """out += v; `assign`: out = 0 + v (the same bits, -0 made +0 as the add makes it)
    without reading out."""
    if assign:
        np.add(v, _ZERO, out=out)
    else:
        out += v


def _q4_decode_chunk(scales: np.ndarray, codes: np.ndarray, k: Scratch,
                     out: np.ndarray | None = None) -> np.ndarray:
    """The values of one chunk of whole blocks, in `out` or else in `k.work` (valid
    until its next use)."""
    v = q4_centered(codes, k)
    return times_scales(v, scales, k, v if out is None else out)


def q4_centered(codes: np.ndarray, k: Scratch) -> np.ndarray:
    """code − 8 of each value of whole blocks, as float32 (exact), in `k.work` (valid
    until its next use)."""
    m = 2 * codes.size
    # byte b -> little-endian uint16 (b & 15, b >> 4): codes of elements 2j, 2j+1
    sp = k.pair[:m // 2]
    np.copyto(sp, codes, casting="unsafe")
    t = k.tmp[:m // 2]
    np.left_shift(sp, 4, out=t)
    sp |= t
    sp &= 0x0F0F
    c = sp.view(np.uint8)
    c -= 8  # code - 8 as an int8's two's complement (uint8 arithmetic wraps)
    v = k.work[:m]
    np.copyto(v, c.view(np.int8), casting="unsafe")  # exact: a cast, a quarter faster
    return v


def times_scales(v: np.ndarray, scales: np.ndarray, k: Scratch, out: np.ndarray) -> np.ndarray:
    """Each block's code − 8 values in `v` times its scale, into `out`: q4's decoded values."""
    m = v.size
    k.wide[:m].reshape(-1, Q4_BLOCK)[...] = scales[:, None]
    np.multiply(v, k.wide[:m], out=out)
    return out


def checked_q4_scales(buf: Payload) -> np.ndarray:
    """q4 block scales (any buffer) as float32, refused unless finite and non-negative."""
    scales = np.frombuffer(buf, dtype=np.float32)
    validate_q4_scales(scales)
    return scales


def _q4_scales(buf: memoryview, numel: int) -> np.ndarray:
    scales = np.frombuffer(buf, dtype=np.float32, count=-(-numel // Q4_BLOCK))
    validate_q4_scales(scales)
    return scales


def validate_q4_scales(scales: Payload, max_abs: float | None = None) -> None:
    """q4 block scales (float32, any buffer) must be finite and non-negative; with
    `max_abs`, small enough that no value decodes beyond it (|x| ≤ 7 × scale)."""
    scales = np.frombuffer(scales, dtype=np.float32)
    if not (np.isfinite(scales).all() and (scales >= 0).all()):
        raise CodecError("q4 payload holds negative or non-finite block scales")
    if max_abs is not None and (scales > max_abs / _Q4_LEVELS).any():
        top = float(scales.max())
        raise CodecError(f"q4 payload holds a block scale of {top:g}: its values reach "
                         f"{top * _Q4_LEVELS:g}, beyond the bound {max_abs:g}")


def q4_error_bound(x: np.ndarray) -> np.ndarray:
    """Per-element bound on |x - q4(x)|: half the step of the element's block."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    nb = -(-x.size // Q4_BLOCK)
    padded = np.zeros(nb * Q4_BLOCK, dtype=np.float32)
    padded[:x.size] = x
    step = np.abs(padded.reshape(nb, Q4_BLOCK)).max(axis=1) / _Q4_LEVELS
    return np.repeat(step / 2, Q4_BLOCK)[:x.size] * (1 + 1e-6)


class Encoder:
    """One payload of `numel` values in `encoding`, filled piece by piece into one
    preallocated buffer (the bytes the client streams; no copy of the whole vector).

    Pieces start at multiples of Q4_BLOCK, so no q4 block straddles two pieces and
    the bytes equal `encode()` of the whole vector (each block is encoded on its own).
    """

    def __init__(self, encoding: str, numel: int):
        self.encoding, self.numel = encoding, int(numel)
        self.buffer = np.empty(encoded_size(encoding, self.numel), dtype=np.uint8)
        self._nb = -(-self.numel // Q4_BLOCK)

    @property
    def payload(self) -> memoryview:
        return self.buffer.data

    def put(self, lo: int, x: np.ndarray, scratch: Scratch | None = None,
            decoded: bool = False) -> np.ndarray | None:
        """Encode x as values [lo, lo + len(x)); refuses non-finite input (CodecError).
        `scratch`: the calling thread's q4 buffers, reused across calls. `decoded`:
        return the decoded values if they come almost free (q4, with a scratch, x of
        at most one chunk; valid until the scratch's next use), else None."""
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        hi = lo + x.size
        if lo % Q4_BLOCK or hi > self.numel or (hi % Q4_BLOCK and hi != self.numel):
            raise ValueError(f"piece [{lo}, {hi}) of {self.numel} is not on q4 block bounds")
        if self.encoding == "q4":
            b0, b1 = lo // Q4_BLOCK, -(-hi // Q4_BLOCK)
            scales = self.buffer[:4 * self._nb].view(np.float32)[b0:b1]
            codes = self.buffer[4 * self._nb:][b0 * Q4_BLOCK // 2:b1 * Q4_BLOCK // 2]
            got = _q4_encode_into(x, scales, codes, scratch, decoded)
            return None if got is None else got[:x.size]
        if self.encoding == "f32":
            _check_finite(x)
            self.buffer.view(np.float32)[lo:hi] = x
        elif self.encoding == "bf16":
            _check_finite(x)
            self.buffer.view(np.uint16)[lo:hi] = np.frombuffer(encode(x, "bf16"), np.uint16)
        else:
            raise CodecError(f"unknown encoding {self.encoding!r}")
        return None

    def decoded(self, lo: int, hi: int, scratch: Scratch | None = None) -> np.ndarray:
        """The decoded values [lo, hi) of what has been put (lo on a block bound). With
        `scratch` and at most one q4 chunk, they are in the scratch (valid until its next
        use), else in a new array."""
        if self.encoding == "f32":
            return self.buffer.view(np.float32)[lo:hi]
        if self.encoding == "bf16":
            raw = self.buffer.view(np.uint16)[lo:hi]
            return (raw.astype(np.uint32) << 16).view(np.float32)
        b0, b1 = lo // Q4_BLOCK, -(-hi // Q4_BLOCK)
        scales = self.buffer[:4 * self._nb].view(np.float32)[b0:b1]
        codes = self.buffer[4 * self._nb:][b0 * Q4_BLOCK // 2:b1 * Q4_BLOCK // 2]
        if scratch is not None and b1 * Q4_BLOCK - lo <= scratch.chunk:
            return _q4_decode_chunk(scales, codes, scratch)[:hi - lo]
        out = np.empty(hi - lo, dtype=np.float32)
        _q4_decode_parts(scales, codes, hi - lo, out, None, scratch)
        return out
