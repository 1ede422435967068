"""The island's delta encoder: the anchor, the uplink's error feedback, and the threads
and scratch of a push's encode.

A push sends anchor − local plus the error-feedback residual, encoded chunk by chunk
straight from the weights, and moves the anchor to local: the anchor is the point up to
which the syncer holds this island's work. Work the syncer does not get (a refused or
lost push, a piece that failed to encode) is carried back into the residual, so it
goes out with the next push.
"""

from __future__ import annotations

import os
import queue
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import numpy as np

from yeto import codec
from yeto.codec import CodecError, Encoder, ErrorFeedback
from yeto.codec.chunked import ranges
from yeto.layout import Fragment

# threads for a push's encode, at most (BENCHMARKS.md, "Spine, island and fault
# benchmarks": scripts/bench_codec.py)
ENCODE_THREADS = 4


def default_threads() -> int:
    """Threads for a push's encode: the cores this process may use, at most
    ENCODE_THREADS (each thread holds one `chunk` piece in flight)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(ENCODE_THREADS, cores))


class DeltaEncoder:
    """anchor − local, with error feedback, for the pushes of an island of `numel`
    values on the `wire` encoding; passes over the weights go `chunk` values at a time,
    encoded by up to `threads` threads. `anchor` is None until the island joins."""

    def __init__(self, numel: int, wire: str, chunk: int, threads: int):
        self.wire, self.chunk, self.threads = wire, chunk, threads
        self.feedback = ErrorFeedback(numel, wire)
        self.anchor: np.ndarray | None = None

    def encode(self, frag: Fragment, w) -> Encoder:
        """anchor − local plus the residual of fragment `frag`, encoded chunk by chunk
        from `w` (an open pass over the weights); the anchor moves to local. The weights
        are read in order (a sharded backend gathers them in turn); the pieces are
        encoded by `threads` threads (numpy lets go of the GIL), each on its own slice
        of the payload, residual and anchor, so the bytes are those of one thread. On a
        CodecError (non-finite weights) the pieces already encoded are carried back, so
        nothing is lost, and it re-raises."""
        enc = Encoder(self.wire, frag.numel)
        done: list[tuple[int, int]] = []
        n = min(self.threads, -(-frag.numel // self.chunk))
        scratch: queue.SimpleQueue = queue.SimpleQueue()  # one per piece in flight
        for _ in range(n + 1 if n > 1 else 1):
            scratch.put(_Scratch(min(self.chunk, frag.numel)))
        with _Workers(n) as workers:
            try:
                for lo, hi in ranges(frag.start, frag.stop, self.chunk):
                    local = w.read(lo, hi)
                    workers.submit(self._piece, enc, frag.start, lo, hi, local, scratch)
                    done += workers.finished()
                done += workers.drain()
            except CodecError:
                done += workers.drain(errors=False)
                for lo, hi in done:
                    self.carry(enc, frag.start, lo, hi)
                raise
        self.feedback.done()
        return enc

    def _piece(self, enc: Encoder, start: int, lo: int, hi: int, local: np.ndarray,
               scratch: queue.SimpleQueue) -> tuple[int, int]:
        """One piece, a q4 chunk at a time: its values stay in the CPU cache from the
        difference to the residual and the anchor's move. A CodecError carries the
        chunks already encoded back (as for whole pieces) and leaves the rest as it was."""
        s = scratch.get()
        try:
            for a, b in ranges(lo, hi, s.codec.chunk):
                mine = local[a - lo:b - lo]
                x = np.subtract(self.anchor[a:b], mine, out=s.x[:b - a])
                try:
                    self.feedback.encode_piece(x, enc, a - start, a, s.codec)
                except CodecError:
                    self.carry(enc, start, lo, a)
                    raise
                self.anchor[a:b] = mine
        finally:
            scratch.put(s)
        return lo, hi

    def carry(self, enc: Encoder, start: int, lo: int, hi: int) -> None:
        """Values [lo, hi) of a payload whose first value is `start` (its fragment's
        start), decoded back into the residual: work the syncer does not hold."""
        for a, b in ranges(lo, hi, self.chunk):
            self.feedback.carry(a, enc.decoded(a - start, b - start))


class _Scratch:
    """What one piece of a push's encode works in: its difference and the codec's
    buffers (a thread holds one while it encodes a piece)."""

    def __init__(self, n: int):
        self.x = np.empty(min(n, codec.CHUNK), dtype=np.float32)
        self.codec = codec.Scratch(self.x.size)


class _Workers:
    """Run calls on up to `n` threads, at most n + 1 at a time (each holds a piece);
    with n = 1, in the caller's thread. `finished()` and `drain()` return the results
    of the calls that completed, in order of completion, and raise the first error."""

    def __init__(self, n: int):
        self.n = max(1, int(n))
        self.pool = ThreadPoolExecutor(self.n, "yeto-encode") if self.n > 1 else None
        self.running: list[Future] = []
        self.results: list = []

    def __enter__(self) -> _Workers:
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    def submit(self, fn, *args) -> None:
        if self.pool is None:
            self.results.append(fn(*args))
            return
        if len(self.running) > self.n:
            wait(self.running, return_when=FIRST_COMPLETED)
            self._collect(errors=True)
        self.running.append(self.pool.submit(fn, *args))

    def finished(self) -> list:
        self._collect(errors=True)
        out, self.results = self.results, []
        return out

    def drain(self, errors: bool = True) -> list:
        """Wait for every call; the results of those that succeeded (raises the first
        error unless `errors` is False)."""
        wait(self.running)
        self._collect(errors)
        out, self.results = self.results, []
        return out

    def _collect(self, errors: bool) -> None:
        first = None
        for f in [f for f in self.running if f.done()]:
            self.running.remove(f)
            if f.exception() is None:
                self.results.append(f.result())
            elif first is None:
                first = f.exception()
        if first is not None and errors:
            raise first
