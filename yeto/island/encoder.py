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
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

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
        """`stage` then `encode_staged`, in the caller's thread."""
        return self.encode_staged(self.stage(frag, w))

    def stage(self, frag: Fragment, w, tidy: bool = True) -> Staged:
        """The part of a push the training loop waits for: for each chunk of fragment
        `frag`, read from `w` (an open pass over the weights), x = residual + (anchor −
        local) goes into the residual (with an f32 wire and no residual: into the
        payload itself), and the anchor moves to local. What is left
        (`encode_staged`) reads neither the weights nor the anchor, so it runs while
        training goes on and broadcasts are applied. The values are those a whole
        encode computes (the same float operations, in the same order).

        The weights are read in order (a sharded backend gathers them in turn); the
        arithmetic runs on `threads` threads (numpy lets go of the GIL). A non-finite x
        raises CodecError: the chunks staged before it stay staged (their work exact in
        the residual, the anchor moved past them), the rest is left as it was. `tidy`:
        drop an f32 residual that is all spent (only in the training thread, which
        alone replaces the residual)."""
        if tidy:
            self.feedback.done()
        enc = Encoder(self.wire, frag.numel)
        into = self.feedback.residual  # None: an f32 wire with nothing carried
        done: list[tuple[int, int]] = []
        n = min(self.threads, -(-frag.numel // self.chunk))
        with _Workers(n) as workers:
            try:
                for lo, hi in ranges(frag.start, frag.stop, self.chunk):
                    local = w.read(lo, hi)
                    workers.submit(self._stage_piece, enc, into, frag.start, lo, hi, local)
                    done += workers.finished()
                done += workers.drain()
            except CodecError:
                done += workers.drain(errors=False)
                if into is None:  # staged into the payload: back into a residual
                    for lo, hi in done:
                        self.carry(enc, frag.start, lo, hi)
                raise
        return Staged(frag, enc, into)

    def _stage_piece(self, enc: Encoder, into: np.ndarray | None, start: int, lo: int,
                     hi: int, local: np.ndarray) -> tuple[int, int]:
        """One piece of `stage`, a q4 chunk at a time (in the CPU cache)."""
        with codec.spare_scratch() as s:
            for a, b in ranges(lo, hi, s.chunk):
                mine = local[a - lo:b - lo]
                x = np.subtract(self.anchor[a:b], mine, out=s.work[:b - a])
                if into is not None:
                    np.add(into[a:b], x, out=x)
                if not (np.isfinite(x.min()) and np.isfinite(x.max())):
                    if into is None:
                        self.carry(enc, start, lo, a)
                    raise CodecError(f"the weights hold non-finite values (near element "
                                     f"{a}): nothing of them is pushed")
                if into is None:
                    enc.put(a - start, x)
                else:
                    into[a:b] = x
                self.anchor[a:b] = mine
        return lo, hi

    def encode_staged(self, staged: Staged) -> Encoder:
        """The staged values into the payload, with the new residual (x − what the
        wire carries) in their place: the part of a push that may run on a
        background thread. On a CodecError the pieces already encoded are carried back
        (the rest still holds x), so nothing is lost, and it re-raises."""
        frag, enc, into = staged.frag, staged.enc, staged.into
        if into is not None:
            done: list[tuple[int, int]] = []
            n = min(self.threads, -(-frag.numel // self.chunk))
            with _Workers(n) as workers:
                try:
                    for lo, hi in ranges(frag.start, frag.stop, self.chunk):
                        workers.submit(self._encode_piece, enc, into, frag.start, lo, hi)
                        done += workers.finished()
                    done += workers.drain()
                except CodecError:
                    done += workers.drain(errors=False)
                    for lo, hi in done:
                        self.carry(enc, frag.start, lo, hi)
                    raise
        return enc

    def _encode_piece(self, enc: Encoder, into: np.ndarray, start: int, lo: int,
                      hi: int) -> tuple[int, int]:
        """One piece of `encode_staged`, a q4 chunk at a time: its values stay in the
        CPU cache from the encode to the residual. A CodecError carries the chunks
        already encoded back and leaves the rest as it was."""
        with codec.spare_scratch() as s:
            for a, b in ranges(lo, hi, s.chunk):
                x = into[a:b]
                try:
                    dec = enc.put(a - start, x, s, decoded=self.wire != "f32")
                except CodecError:
                    self.carry(enc, start, lo, a)
                    raise
                if self.wire == "f32":
                    x[...] = 0.0
                else:
                    if dec is None:
                        dec = enc.decoded(a - start, b - start, s)
                    np.subtract(x, dec, out=x)
        return lo, hi

    def carry(self, enc: Encoder, start: int, lo: int, hi: int) -> None:
        """Values [lo, hi) of a payload whose first value is `start` (its fragment's
        start), decoded back into the residual: work the syncer does not hold."""
        for a, b in ranges(lo, hi, self.chunk):
            self.feedback.carry(a, enc.decoded(a - start, b - start))


@dataclass
class Staged:
    """A push staged by `DeltaEncoder.stage`: its fragment, its payload (filled by
    `encode_staged`, or already, with an f32 wire and no residual) and the residual
    array its values wait in (None: they are in the payload)."""

    frag: Fragment
    enc: Encoder
    into: np.ndarray | None


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


class Inline(Executor):
    """An executor that runs each call in the caller's thread, at once (a push encoded
    and sent before the training loop goes on)."""

    def submit(self, fn, *args, **kwargs) -> Future:
        f: Future = Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - the future carries it, as an executor's
            f.set_exception(e)
        return f
