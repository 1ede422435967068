"""Chunked codec work for the syncer: nothing here holds more than one chunk of
decoded values, whatever the size of the vector.

- `chunk_payload`: the encoded bytes of elements [lo, hi) of a payload (q4: the
  block scales and codes of those blocks; f32/bf16: a zero-copy slice), so that
  `yeto.codec` decodes or encodes a chunk exactly as it would the whole vector
  (q4 blocks are independent; chunk bounds are multiples of `codec.Q4_BLOCK`).
- `decode_add`: acc += w * decode(payload) (the bits of `codec.decode_add`);
  `decode_add_norm`: the same and the payload's L2 norm, in one pass (RDA needs each
  push's norm); `norm`: the norm alone (clipping).
- `encode_diff`: encode(a - b) chunk by chunk into one output buffer, and b += the
  decoded update, in place (the compressed downlink).
- `PayloadReceiver`: assembles a push from its gRPC chunks into one buffer of the
  wire size, validating as bytes arrive (q4 scales as soon as they are in, f32/bf16
  values as they come), so a bad push is refused before it is held whole.
- `SpilledPayload`: the same bytes in an unlinked temporary file instead of memory
  (large pushes: a push in flight then costs the syncer a chunk of memory, not its
  wire size); every function here reads it as it reads a buffer, same bits.

Chunks are independent, so large vectors are worked on by a few threads at once
(`each_chunk`; numpy releases the GIL inside each operation): the same bits as one
thread, in a fraction of the time on a machine with cores to spare. Norms are
float32 dot products over fixed chunks of `CHUNK` elements at absolute offsets,
summed in float64 in order, so any caller gets the same bits for the same payload.

These functions only compose `yeto.codec`'s encoders and decoders; `chunk_payload`,
`encode_diff` and `PayloadReceiver` would sit well in `yeto/codec.py` too.
"""

from __future__ import annotations

import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from yeto import codec

CHUNK = 1 << 17  # elements per chunk: a multiple of codec.Q4_BLOCK (as codec's own)
THREADS = max(1, min(8, os.cpu_count() or 1))
_ITEM = {"f32": 4, "bf16": 2}
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def chunks(numel: int, step: int = CHUNK):
    """(lo, hi) element ranges covering [0, numel) at absolute multiples of `step`."""
    for lo in range(0, numel, step):
        yield lo, min(lo + step, numel)


def each_chunk(numel: int, fn) -> list:
    """[fn(lo, hi) for each chunk], in chunk order, spread over `THREADS` threads when
    there are several chunks. fn must touch only its own chunk's elements."""
    global _pool
    ranges = list(chunks(numel))
    if THREADS == 1 or len(ranges) < 4:
        return [fn(lo, hi) for lo, hi in ranges]
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(THREADS, thread_name_prefix="syncer-chunks")
    per = -(-len(ranges) // THREADS)  # contiguous runs of chunks: one task per thread

    def run(i: int) -> list:
        return [fn(lo, hi) for lo, hi in ranges[i * per:(i + 1) * per]]

    return [r for part in _pool.map(run, range(THREADS)) for r in part]


def chunk_payload(buf, encoding: str, numel: int, lo: int, hi: int):
    """The encoded bytes of elements [lo, hi) (lo a multiple of codec.Q4_BLOCK) of a
    buffer or a `SpilledPayload`."""
    read = buf.read if isinstance(buf, SpilledPayload) else memoryview(buf).cast("B").__getitem__
    if encoding in _ITEM:
        k = _ITEM[encoding]
        return read(slice(k * lo, k * hi))
    if encoding != "q4":
        raise codec.CodecError(f"unknown encoding {encoding!r}")
    nb = -(-numel // codec.Q4_BLOCK)
    b0, b1 = lo // codec.Q4_BLOCK, -(-hi // codec.Q4_BLOCK)
    half = codec.Q4_BLOCK // 2
    return b"".join((read(slice(4 * b0, 4 * b1)),
                     read(slice(4 * nb + half * b0, 4 * nb + half * b1))))


def _checked(payload, encoding: str, numel: int):
    mv = payload if isinstance(payload, SpilledPayload) else memoryview(payload).cast("B")
    want = codec.encoded_size(encoding, numel)
    if len(mv) != want:
        raise codec.CodecError(f"{encoding} payload for {numel} elements must be {want} "
                               f"bytes, got {len(mv)}")
    return mv


def decode_add(payload, encoding: str, numel: int, acc: np.ndarray, weight: float,
               assign: bool = False) -> None:
    """acc += weight * decode(payload) (`assign`: acc = ...), chunk by chunk: the bits
    of `codec.decode_add`. Validate first (`codec.validate`): a bad chunk found midway
    would leave acc half-added."""
    mv = _checked(payload, encoding, numel)

    def one(lo: int, hi: int) -> None:
        codec.decode_add(chunk_payload(mv, encoding, numel, lo, hi), encoding, hi - lo,
                         acc[lo:hi], weight, assign)

    each_chunk(numel, one)


def decode_add_norm(payload, encoding: str, numel: int, acc: np.ndarray | None,
                    weight: float, assign: bool = False) -> float:
    """`decode_add` (when acc is not None) and the L2 norm of decode(payload), in one
    pass. Validate first."""
    mv = _checked(payload, encoding, numel)
    w32 = np.float32(weight)

    def one(lo: int, hi: int) -> float:
        v = codec.decode(chunk_payload(mv, encoding, numel, lo, hi), encoding, hi - lo)
        square = _square_sum(v)
        if acc is not None:
            v *= w32
            codec.add_to(acc[lo:hi], v, assign)
        return square

    return float(np.sqrt(sum(each_chunk(numel, one))))


def norm(payload, encoding: str, numel: int) -> float:
    """L2 norm of decode(payload), one chunk at a time."""
    return decode_add_norm(payload, encoding, numel, None, 0.0)


def vector_norm(x: np.ndarray) -> float:
    """L2 norm of a float32 vector, with the same float64 chunk sums as `norm`."""
    return float(np.sqrt(sum(each_chunk(x.size, lambda lo, hi: _square_sum(x[lo:hi])))))


def _square_sum(v: np.ndarray) -> float:
    """Σ v² of one chunk: a float32 dot product (BLAS; a float64 copy of the chunk
    first cost 100x more here), summed over chunks in float64 by the callers."""
    return float(np.dot(v, v))


def encode_diff(a: np.ndarray, b: np.ndarray, encoding: str) -> np.ndarray:
    """Return encode(a - b) as a uint8 array (the same bytes as `codec.encode`) and
    add its decoded value to b in place: afterwards b holds exactly what a receiver
    holding the old b gets by adding the payload. Chunk-sized scratch only."""
    numel = a.size
    out = np.empty(codec.encoded_size(encoding, numel), np.uint8)

    def one(lo: int, hi: int) -> None:
        piece = codec.encode(a[lo:hi] - b[lo:hi], encoding)
        _place(out, encoding, numel, lo, hi, piece)
        codec.decode_add(piece, encoding, hi - lo, b[lo:hi], 1.0)

    each_chunk(numel, one)
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


class Pool:
    """What one push in flight needs, kept for the next push instead of made anew: a
    fresh receive buffer costs a page fault per 4 KiB on first touch (on a VM, more
    than receiving the bytes), a fresh spill file twice the time of rewriting an old
    one (its page cache is allocated anew). Holds at most `limit` (one per push in
    flight), so it adds nothing to the peak the in-flight bound already allows.

    `make(size)` builds a new one; `reuse(thing, size)` readies a kept one for `size`
    bytes, or returns None when it cannot serve that size; `drop(thing)` releases one
    the pool has no room for (default: nothing to release)."""

    def __init__(self, limit: int, make, reuse, drop=lambda thing: None):
        self.limit, self.make, self.reuse, self.drop = max(0, limit), make, reuse, drop
        self._free: list = []
        self._lock = threading.Lock()

    def get(self, size: int):
        with self._lock:
            for i, thing in enumerate(self._free):
                ready = self.reuse(thing, size)
                if ready is not None:
                    del self._free[i]
                    return ready
        return self.make(size)

    def put(self, thing) -> None:
        with self._lock:
            self._free.append(thing)
            keep = max(0, len(self._free) - self.limit)
            dropped, self._free = self._free[:keep], self._free[keep:]
        for extra in dropped:
            self.drop(extra)


def buffer_pool(limit: int) -> Pool:
    """Receive buffers (uint8 arrays), each reused for a push of its own size."""
    return Pool(limit, lambda size: np.empty(size, np.uint8),
                lambda buf, size: buf if buf.size == size else None)


def spill_pool(limit: int, directory: str | os.PathLike | None = None) -> Pool:
    """Spill files (`SpilledPayload`), each rewritten from its start by the next push."""
    return Pool(limit, lambda size: SpilledPayload(size, directory),
                lambda spilled, size: spilled.reset(size), SpilledPayload.close)


class SpilledPayload:
    """A payload's bytes in an unlinked temporary file in `directory` (the system's
    temporary folder by default): written in order as they arrive, read back by
    position from any thread. The file vanishes on `close()` (or when collected)."""

    def __init__(self, size: int, directory: str | os.PathLike | None = None):
        self.file = tempfile.TemporaryFile(dir=directory, buffering=0)  # pread sees writes
        self.fd = self.file.fileno()
        self.reset(size)

    def reset(self, size: int) -> SpilledPayload:
        """Hold a new payload of `size` bytes, written from the start over the old
        bytes (a file longer than `size` keeps its tail, never read)."""
        self.size = size
        self.file.seek(0)
        return self

    def __len__(self) -> int:
        return self.size

    def write(self, piece) -> None:
        view = memoryview(piece).cast("B")
        while view:  # an unbuffered write may take part of it
            view = view[self.file.write(view):]

    def read(self, part: slice) -> bytes:
        n = part.stop - part.start
        data = os.pread(self.fd, n, part.start)
        while len(data) < n:  # a short read is legal; finish it
            more = os.pread(self.fd, n - len(data), part.start + len(data))
            if not more:
                raise codec.CodecError(f"spilled payload ends at byte {part.start + len(data)}")
            data += more
        return data

    def close(self) -> None:
        self.file.close()


class PayloadReceiver:
    """Assembles one payload of `encoding`/`numel` from byte pieces into `into`: a
    uint8 array of the wire size (a new one by default) or a `SpilledPayload`.
    Validates on arrival: q4 block scales (they lead the payload), f32/bf16 values,
    each up to the last whole float received: finite, and with `max_abs` within it
    (`syncer.bounds`). `add` raises `codec.CodecError` on the
    first bad byte and `ValueError` on a payload longer than announced; `finish`
    raises `ValueError` on a short one and returns `into`."""

    def __init__(self, encoding: str, numel: int, into=None, max_abs: float | None = None):
        self.encoding, self.numel, self.max_abs = encoding, numel, max_abs
        self.size = codec.encoded_size(encoding, numel)
        self.buf = np.empty(self.size, np.uint8) if into is None else into
        if len(self.buf) != self.size:
            raise ValueError(f"buffer of {len(self.buf)} bytes for a {self.size}-byte payload")
        self.n = 0           # bytes received
        self._tail = b""     # received bytes of a value not yet whole (validated later)
        # bytes that are floats to check: q4's block scales, all of f32/bf16
        self._check_end = 4 * -(-numel // codec.Q4_BLOCK) if encoding == "q4" else self.size

    def add(self, piece) -> None:
        k = len(piece)
        if self.n + k > self.size:
            raise ValueError(f"payload exceeds the {self.size} bytes its header announced")
        if self.n < self._check_end:
            self._validate(memoryview(piece)[:self._check_end - self.n])
        if isinstance(self.buf, SpilledPayload):
            self.buf.write(piece)
        else:
            self.buf[self.n:self.n + k] = np.frombuffer(piece, np.uint8)
        self.n += k

    def _validate(self, part: memoryview) -> None:
        item = 4 if self.encoding == "q4" else _ITEM[self.encoding]
        data = self._tail + bytes(part) if self._tail else part
        whole = len(data) - len(data) % item
        if whole and self.encoding == "q4":
            codec.validate_q4_scales(data[:whole], self.max_abs)
        elif whole:
            codec.validate(data[:whole], self.encoding, whole // item, self.max_abs)
        self._tail = bytes(data[whole:])

    def finish(self):
        if self.n != self.size:
            raise ValueError(f"payload ended after {self.n} of {self.size} bytes")
        return self.buf
