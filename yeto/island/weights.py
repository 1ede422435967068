"""Passes over an island's weights through the `yeto.loop.Weights` protocol: `layout`,
`get() -> np.ndarray`, `set(flat)`, and, when the backend has them, range access
`read_range(lo, hi) -> np.ndarray` / `write_range(lo, hi, values)` plus an optional
`flush()` after a batch of range accesses. An apply computes in the array `read_range`
returned and hands that array to `write_range`, which may be a view of the weights
themselves."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np

from yeto.codec.chunked import ranges
from yeto.layout import Layout
from yeto.memory import trim


class FlatWeights:
    """`yeto.loop.Weights` from two callbacks: `get()` returns the trainable values as
    one flat float32 array in canonical order, `set(flat)` takes them back (no range
    access: each pass costs one flat copy)."""

    def __init__(self, layout: Layout, get: Callable[[], np.ndarray],
                 set: Callable[[np.ndarray], None]):
        self.layout, self.get, self.set = layout, get, set


class _Direct:
    """One pass over the weights through the backend's own range access."""

    def __init__(self, read, write):
        self.read, self.write = read, write


class _Flat:
    """One pass over the weights of a backend without range access: one get() at the
    start, one set() at the end (when written)."""

    def __init__(self, flat: np.ndarray):
        self.flat, self.dirty = flat, False

    def read(self, lo: int, hi: int) -> np.ndarray:
        return self.flat[lo:hi]

    def write(self, lo: int, hi: int, values: np.ndarray) -> None:
        self.flat[lo:hi] = values
        self.dirty = True


def reading(source) -> _Direct:
    """A read-only pass over `source`'s `read_range` (a backend's snapshot)."""
    return _Direct(source.read_range, None)


@contextlib.contextmanager
def _trimmed(view):
    try:
        yield view
    finally:
        del view
        trim()


class WeightPasses:
    """Range access to `weights` for one pass at a time (push, apply, start): the
    backend's own when it has it, else one flat copy per pass. Freed buffers go back
    to the OS after each pass (`yeto.memory.trim`)."""

    def __init__(self, weights):
        self.weights = weights
        self._read = getattr(weights, "read_range", None)
        self._write = getattr(weights, "write_range", None)
        self._flush = getattr(weights, "flush", None)
        if (self._read is None) != (self._write is None):
            raise ValueError("give both read_range and write_range, or neither")

    @contextlib.contextmanager
    def open(self) -> Iterator[_Direct | _Flat]:
        if self._read is not None:
            try:
                yield _Direct(self._read, self._write)
            finally:
                if self._flush is not None:
                    self._flush()
                trim()
            return
        view = _Flat(np.asarray(self.weights.get(), dtype=np.float32))
        try:
            yield view
        finally:
            if view.dirty:
                self.weights.set(view.flat)
            del view
            trim()

    def read_only(self):
        """A read-only pass that another thread may run, opened now: the backend's range
        reads (the weights must not change until it is done), or, without range access,
        the flat values this pass reads anyway, taken now."""
        if self._read is not None:
            return _trimmed(_Direct(self._read, None))
        return _trimmed(_Flat(np.asarray(self.weights.get(), dtype=np.float32)))

    def read_all(self, numel: int, chunk: int) -> np.ndarray:
        """The weights as a new flat array, chunk by chunk."""
        if self._read is None:
            return np.array(self.weights.get(), dtype=np.float32)
        out = np.empty(numel, dtype=np.float32)
        with self.open() as w:
            for lo, hi in ranges(0, numel, chunk):
                out[lo:hi] = w.read(lo, hi)
        return out
