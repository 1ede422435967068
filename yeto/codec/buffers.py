"""Where a payload's bytes wait while it is received and used: pooled buffers, and
`SpilledPayload`, an unlinked temporary file (a large push in flight then costs its
holder a chunk of memory, not its wire size)."""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import numpy as np

from yeto.codec.format import CodecError, Payload, as_view

T = TypeVar("T")


class Pool(Generic[T]):
    """What one push in flight needs, kept for the next push instead of made anew: a
    fresh receive buffer costs a page fault per 4 KiB on first touch, a fresh spill
    file more than rewriting an old one, its page cache allocated anew (BENCHMARKS.md,
    "Memory: bytes per parameter"). Holds at most `limit` (one per push in flight),
    so it adds nothing to the peak the in-flight bound already allows.

    `make(size)` builds a new one; `reuse(thing, size)` readies a kept one for `size`
    bytes, or returns None when it cannot serve that size; `drop(thing)` releases one
    the pool has no room for (default: nothing to release)."""

    def __init__(self, limit: int, make: Callable[[int], T], reuse: Callable[[T, int], T | None],
                 drop: Callable[[T], None] = lambda thing: None):
        self.limit, self.make, self.reuse, self.drop = max(0, limit), make, reuse, drop
        self._free: list[T] = []
        self._lock = threading.Lock()

    def get(self, size: int) -> T:
        with self._lock:
            for i, thing in enumerate(self._free):
                ready = self.reuse(thing, size)
                if ready is not None:
                    del self._free[i]
                    return ready
        return self.make(size)

    def put(self, thing: T) -> None:
        with self._lock:
            self._free.append(thing)
            keep = max(0, len(self._free) - self.limit)
            dropped, self._free = self._free[:keep], self._free[keep:]
        for extra in dropped:
            self.drop(extra)


def buffer_pool(limit: int) -> Pool[np.ndarray]:
    """Receive buffers (uint8 arrays), each reused for a push of its own size."""
    return Pool(limit, lambda size: np.empty(size, np.uint8),
                lambda buf, size: buf if buf.size == size else None)


def spill_pool(limit: int, directory: str | os.PathLike[str] | None = None
               ) -> Pool[SpilledPayload]:
    """Spill files (`SpilledPayload`), each rewritten from its start by the next push."""
    return Pool(limit, lambda size: SpilledPayload(size, directory),
                lambda spilled, size: spilled.reset(size), SpilledPayload.close)


class SpilledPayload:
    """A payload's bytes in an unlinked temporary file in `directory` (the system's
    temporary folder by default): written in order as they arrive, read back by
    position from any thread. The file vanishes on `close()` (or when collected)."""

    def __init__(self, size: int, directory: str | os.PathLike[str] | None = None):
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

    def write(self, piece: Payload) -> None:
        view = as_view(piece).cast("B")
        while view:  # an unbuffered write may take part of it
            view = view[self.file.write(view):]

    def read(self, part: slice) -> bytes:
        n = part.stop - part.start
        data = os.pread(self.fd, n, part.start)
        while len(data) < n:  # a short read is legal; finish it
            more = os.pread(self.fd, n - len(data), part.start + len(data))
            if not more:
                raise CodecError(f"spilled payload ends at byte {part.start + len(data)}")
            data += more
        return data

    def read_into(self, part: slice, into: np.ndarray) -> np.ndarray:
        """Bytes `part` read into the start of `into` (a uint8 array at least that
        long), no bytes object made; returns the filled view."""
        n = part.stop - part.start
        out, got = into[:n], 0
        while got < n:  # a short read is legal; finish it
            k = os.preadv(self.fd, [out[got:].data], part.start + got)
            if k <= 0:
                raise CodecError(f"spilled payload ends at byte {part.start + got}")
            got += k
        return out

    def close(self) -> None:
        self.file.close()
