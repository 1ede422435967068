"""Chunked codec work over vectors of any size: nothing here holds more than one chunk
of decoded values, whatever the size of the vector.

- `ranges`: (lo, hi) pieces of [start, stop), the one range helper of the codebase.
- `chunk_payload`: the encoded bytes of elements [lo, hi) of a payload (q4: the
  block scales and codes of those blocks; f32/bf16: a zero-copy slice), so that the
  format's functions decode or encode a chunk exactly as they would the whole vector
  (q4 blocks are independent; chunk bounds are multiples of `Q4_BLOCK`).
- `decode_add`: acc += w * decode(payload) (the bits of `yeto.codec.decode_add`);
  `decode_add_norm`: the same and the payload's L2 norm, in one pass (RDA needs each
  push's norm); `norm`: the norm alone (clipping); `vector_norm`: a vector's.
- `encode_diff`: encode(a - b) chunk by chunk into one output buffer, and b += the
  decoded update, in place (the compressed downlink).
- `q4_chunk_parts` and `q4_add_square`: a q4 chunk as its scales and codes, views of
  the payload or read from a spill file into a scratch, summed in one compiled pass
  (`yeto.codec.kernels`): the syncer's sums make no bytes object per chunk.
  A q4 payload's norm is defined on its codes (`yeto.codec.kernels`); f32 and bf16
  norms are float32 dot products.

Payloads are buffers or `yeto.codec.buffers.SpilledPayload`s (bytes in a temporary
file); every function here reads both alike, same bits.

Chunks are independent, so large vectors are worked on by a few threads at once
(`each_chunk`; numpy releases the GIL inside each operation): the same bits as one
thread, in a fraction of the time on a machine with cores to spare. Norms are
float32 dot products over fixed chunks of `CHUNK` elements at absolute offsets,
summed in float64 in order, so any caller gets the same bits for the same payload.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeAlias, TypeVar

import numpy as np

from yeto.codec import format as fmt
from yeto.codec import kernels
from yeto.codec.buffers import SpilledPayload
from yeto.codec.format import CHUNK, Q4_BLOCK, CodecError, Payload, as_view

R = TypeVar("R")
# a whole payload: its bytes in memory, or spilled to a file
AnyPayload: TypeAlias = Payload | SpilledPayload

THREADS = max(1, min(8, os.cpu_count() or 1))
ITEM = {"f32": 4, "bf16": 2}  # bytes per value of the unblocked encodings
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def ranges(start: int, stop: int, step: int = CHUNK) -> Iterator[tuple[int, int]]:
    """[start, stop) in (lo, hi) pieces of `step` values, counted from `start`."""
    for lo in range(start, stop, step):
        yield lo, min(lo + step, stop)


def each_chunk(numel: int, fn: Callable[[int, int], R], size: int = CHUNK) -> list[R]:
    """[fn(lo, hi) for each chunk of `size` values], in chunk order, spread over
    `THREADS` threads when there are several chunks. fn must touch only its own chunk's
    elements."""
    global _pool
    pieces = list(ranges(0, numel, size))
    if THREADS == 1 or len(pieces) < 4:
        return [fn(lo, hi) for lo, hi in pieces]
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(THREADS, thread_name_prefix="codec-chunks")
    per = -(-len(pieces) // THREADS)  # contiguous runs of chunks: one task per thread

    def run(i: int) -> list[R]:
        return [fn(lo, hi) for lo, hi in pieces[i * per:(i + 1) * per]]

    return [r for part in _pool.map(run, range(THREADS)) for r in part]


def chunk_payload(buf: AnyPayload, encoding: str, numel: int, lo: int, hi: int
                  ) -> bytes | memoryview:
    """The encoded bytes of elements [lo, hi) (lo a multiple of Q4_BLOCK) of a
    buffer or a `SpilledPayload`."""
    read: Callable[[slice], bytes | memoryview] = (
        buf.read if isinstance(buf, SpilledPayload) else as_view(buf).cast("B").__getitem__)
    if encoding in ITEM:
        k = ITEM[encoding]
        return read(slice(k * lo, k * hi))
    if encoding != "q4":
        raise CodecError(f"unknown encoding {encoding!r}")
    nb = -(-numel // Q4_BLOCK)
    b0, b1 = lo // Q4_BLOCK, -(-hi // Q4_BLOCK)
    half = Q4_BLOCK // 2
    return b"".join((read(slice(4 * b0, 4 * b1)),
                     read(slice(4 * nb + half * b0, 4 * nb + half * b1))))


def _checked(payload: AnyPayload, encoding: str, numel: int) -> memoryview | SpilledPayload:
    mv = payload if isinstance(payload, SpilledPayload) else as_view(payload).cast("B")
    want = fmt.encoded_size(encoding, numel)
    if len(mv) != want:
        raise CodecError(f"{encoding} payload for {numel} elements must be {want} "
                         f"bytes, got {len(mv)}")
    return mv


def decode_add(payload: AnyPayload, encoding: str, numel: int, acc: np.ndarray, weight: float,
               assign: bool = False) -> None:
    """acc += weight * decode(payload) (`assign`: acc = ...), chunk by chunk: the bits
    of `yeto.codec.decode_add`. Validate first (`yeto.codec.validate`): a bad chunk
    found midway would leave acc half-added."""
    mv = _checked(payload, encoding, numel)

    def one(lo: int, hi: int) -> None:
        fmt.decode_add(chunk_payload(mv, encoding, numel, lo, hi), encoding, hi - lo,
                       acc[lo:hi], weight, assign)

    each_chunk(numel, one)


def decode_add_norm(payload: AnyPayload, encoding: str, numel: int, acc: np.ndarray | None,
                    weight: float, assign: bool = False) -> float:
    """`decode_add` (when acc is not None) and the L2 norm of decode(payload), in one
    pass. Validate first."""
    mv = _checked(payload, encoding, numel)
    w32 = np.float32(weight)

    def one(lo: int, hi: int) -> float:
        part = None if acc is None else acc[lo:hi]
        if encoding != "q4":
            return decode_add_square(chunk_payload(mv, encoding, numel, lo, hi), encoding,
                                     hi - lo, part, w32, assign)
        with fmt.spare_scratch() as k:  # the codes read into the scratch: no joined copy
            scales, codes = q4_chunk_parts(mv, numel, lo, hi, k.nib)
            return q4_add_square(scales, codes, hi - lo, part, w32, assign)

    return float(np.sqrt(sum(each_chunk(numel, one))))


def decode_add_square(piece: Payload, encoding: str, n: int, acc: np.ndarray | None,
                      weight: np.float32, assign: bool = False) -> float:
    """One chunk of `decode_add_norm`: acc += weight * decode(piece) (`assign`: =), and
    Σ decode(piece)² as a float (the chunk's term of the norm)."""
    if encoding == "q4" and n <= CHUNK:
        head = 4 * -(-n // Q4_BLOCK)
        buf = as_view(piece).cast("B")
        if len(buf) != fmt.encoded_size("q4", n):
            raise CodecError(f"q4 payload for {n} elements must be "
                             f"{fmt.encoded_size('q4', n)} bytes, got {len(buf)}")
        return q4_add_square(buf[:head], buf[head:], n, acc, weight, assign)
    v = fmt.decode(piece, encoding, n)
    square = _square_sum(v)
    if acc is not None:
        v *= weight
        fmt.add_to(acc, v, assign)
    return square


def q4_add_square(scales: Payload, codes: Payload, n: int, acc: np.ndarray | None,
                  weight: np.float32, assign: bool) -> float:
    """`decode_add_square` of one q4 chunk given as its block scales and its codes
    (buffers, at most one chunk): one compiled pass where numba is installed
    (`yeto.codec.kernels`), the same bits either way."""
    return kernels.q4_add_square(fmt.checked_q4_scales(scales), codes, n, acc, weight, assign)


def q4_chunk_parts(payload: memoryview | SpilledPayload, numel: int, lo: int, hi: int,
                   into: np.ndarray) -> tuple[Payload, Payload]:
    """(block scales, codes) of elements [lo, hi) (lo a multiple of Q4_BLOCK) of a q4
    payload: views of a buffer, or read from a `SpilledPayload` (the codes straight
    into `into`, a uint8 array of at least their size)."""
    nb = -(-numel // Q4_BLOCK)
    b0, b1 = lo // Q4_BLOCK, -(-hi // Q4_BLOCK)
    half = Q4_BLOCK // 2
    scales, codes = slice(4 * b0, 4 * b1), slice(4 * nb + half * b0, 4 * nb + half * b1)
    if isinstance(payload, SpilledPayload):
        return payload.read(scales), payload.read_into(codes, into)
    return payload[scales], payload[codes]


def norm(payload: AnyPayload, encoding: str, numel: int) -> float:
    """L2 norm of decode(payload), one chunk at a time."""
    return decode_add_norm(payload, encoding, numel, None, 0.0)


def vector_norm(x: np.ndarray) -> float:
    """L2 norm of a float32 vector, with the same float64 chunk sums as `norm`."""
    return float(np.sqrt(sum(each_chunk(x.size, lambda lo, hi: _square_sum(x[lo:hi])))))


def _square_sum(v: np.ndarray) -> float:
    """Σ v² of one chunk: a float32 dot product (BLAS, no float64 copy of the chunk),
    summed over chunks in float64 by the callers."""
    return float(np.dot(v, v))


def encode_diff(a: np.ndarray, b: np.ndarray, encoding: str) -> np.ndarray:
    """Return encode(a - b) as a uint8 array (the same bytes as `yeto.codec.encode`)
    and add its decoded value to b in place: afterwards b holds exactly what a receiver
    holding the old b gets by adding the payload. Chunk-sized scratch only."""
    numel = a.size
    out = np.empty(fmt.encoded_size(encoding, numel), np.uint8)

    def one(lo: int, hi: int) -> None:
        piece = fmt.encode(a[lo:hi] - b[lo:hi], encoding)
        _place(out, encoding, numel, lo, hi, piece)
        fmt.decode_add(piece, encoding, hi - lo, b[lo:hi], 1.0)

    each_chunk(numel, one)
    return out


def _place(out: np.ndarray, encoding: str, numel: int, lo: int, hi: int, piece: bytes) -> None:
    """Write the encoding of elements [lo, hi) into its place in the whole payload."""
    src = np.frombuffer(piece, np.uint8)
    if encoding in ITEM:
        k = ITEM[encoding]
        out[k * lo:k * hi] = src
        return
    nb = -(-numel // Q4_BLOCK)
    b0, b1 = lo // Q4_BLOCK, -(-hi // Q4_BLOCK)
    half = Q4_BLOCK // 2
    out[4 * b0:4 * b1] = src[:4 * (b1 - b0)]
    out[4 * nb + half * b0:4 * nb + half * b1] = src[4 * (b1 - b0):]
