"""An island's weights (`Weights`) and the passes the island makes over them
(`WeightPasses`): through the backend's own range access when it has it, else through
one flat copy per pass."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from typing import ClassVar, Protocol

import numpy as np

from yeto.codec.chunked import ranges
from yeto.layout import Layout
from yeto.memory import trim

DIGEST_CHUNK = 1 << 20  # values per read of `Weights.digest`


class Snapshot(Protocol):
    """A read-only copy of a range of the weights (`Weights.snapshot`)."""

    def read_range(self, lo: int, hi: int) -> np.ndarray: ...


class Weights(Protocol):
    """A backend's trainable weights as one flat float32 vector in canonical order:
    `layout` names and places every tensor, `get()` returns the whole vector and
    `set(flat)` takes it back.

    Range access: `ranged` True says that `read_range(lo, hi)` and `write_range(lo, hi,
    values)` reach the backend's tensors directly, so the island works chunk by chunk
    without a flat copy of the model, and calls `flush()` after each pass of range
    accesses. The island may change the array `read_range` returns and hand it back to
    `write_range`: a read may be a view of the weights (a write of that same view then
    has nothing to copy). With `ranged` False each pass of the island costs one `get()`
    and, when it writes, one `set()`.

    Implementations subclass `Weights`, which gives them the defaults below: range
    access through `get`/`set`, no `flush` work, no `snapshot`, and a `digest` read
    through them."""

    layout: Layout
    ranged: ClassVar[bool] = False

    def get(self) -> np.ndarray: ...

    def set(self, flat: np.ndarray) -> None: ...

    def read_range(self, lo: int, hi: int) -> np.ndarray:
        """Values [lo, hi) of the flat vector."""
        return np.array(self.get()[lo:hi], dtype=np.float32)

    def write_range(self, lo: int, hi: int, values: np.ndarray) -> None:
        """Set values [lo, hi) of the flat vector."""
        flat = np.array(self.get(), dtype=np.float32)
        flat[lo:hi] = values
        self.set(flat)

    def flush(self) -> None:
        """End of a pass of range accesses (a backend that holds pieces writes them)."""

    def snapshot(self, lo: int, hi: int) -> Snapshot | None:
        """A read-only copy of values [lo, hi), taken now without the training loop
        waiting for it (read through its `read_range` by a push's background thread
        while training changes the weights), or None: the push is then staged from the
        weights themselves."""
        return None

    def digest(self) -> str:
        """SHA-256 of the flat float32 vector in canonical order."""
        h = hashlib.sha256()
        if not self.ranged:
            h.update(np.asarray(self.get(), dtype=np.float32).tobytes())
            return h.hexdigest()
        for lo, hi in ranges(0, self.layout.numel, DIGEST_CHUNK):
            h.update(np.asarray(self.read_range(lo, hi), dtype=np.float32).tobytes())
        self.flush()
        return h.hexdigest()


class FlatWeights(Weights):
    """`Weights` from two callbacks: `get()` returns the trainable values as one flat
    float32 array in canonical order, `set(flat)` takes them back (no range access:
    each pass costs one flat copy)."""

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


def reading(source: Snapshot) -> _Direct:
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
    backend's own when it has it (`Weights.ranged`), else one flat copy per pass. Freed
    buffers go back to the OS after each pass (`yeto.memory.trim`)."""

    def __init__(self, weights: Weights):
        self.weights = weights

    @contextlib.contextmanager
    def open(self) -> Iterator[_Direct | _Flat]:
        if self.weights.ranged:
            try:
                yield _Direct(self.weights.read_range, self.weights.write_range)
            finally:
                self.weights.flush()
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
        if self.weights.ranged:
            return _trimmed(_Direct(self.weights.read_range, None))
        return _trimmed(_Flat(np.asarray(self.weights.get(), dtype=np.float32)))

    def read_all(self, numel: int, chunk: int) -> np.ndarray:
        """The weights as a new flat array, chunk by chunk."""
        if not self.weights.ranged:
            return np.array(self.weights.get(), dtype=np.float32)
        out = np.empty(numel, dtype=np.float32)
        with self.open() as w:
            for lo, hi in ranges(0, numel, chunk):
                out[lo:hi] = w.read(lo, hi)
        return out
