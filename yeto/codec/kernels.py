"""The syncer's hot loops as compiled passes: a q4 chunk decoded, weighted
and added into the round's sum with its squared norm, reading each code once
(`q4_add_square`); the outer step with its finiteness check (`outer_step`); and the
median of each column of a round's island rows (`column_median`, the centre bound).

numpy cannot fuse these: its q4 decode and sum take about eleven passes over each chunk
(unpack, cast, spread the scales, multiply, square, weight, add), 1.7-2x the CPU a
round's bytes need at memcpy speed, and the outer step five more. With numba installed
(`pip install 'yeto[fast]'`) each runs as one loop compiled on first use; without it, a
numpy twin gives the same bits, only slower. tests/unit/test_kernels.py holds the two
to that.

The bits:
- the sum: acc + (float32(code - 8) * scale) * weight, each operation rounded to
  float32 in that order (no fused multiply-add), as `yeto.codec.decode_add` does it;
  `assign` writes 0 + that instead of reading acc (-0 made +0, as adding makes it).
- the norm: a q4 chunk's Σ v² is defined on its codes, Σ over blocks of
  scale² x Σ (code - 8)², in float64, the blocks added in order. The inner sum is an
  exact integer, so this is the values' squared norm to float64 precision, and both
  implementations compute it in the same order.
- the outer step: as `syncer.strategy.Nesterov` writes it, each operation rounded to
  float32 (`outer_step`).
- the median: the middle value of each column's sorted values, or for an even count
  float32(a + b) × 0.5 of the middle two (`column_median`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Callable, Iterator
from typing import Any, Literal, NamedTuple

import numpy as np

from yeto.codec import format as fmt
from yeto.codec.format import Q4_BLOCK

HALF = Q4_BLOCK // 2  # code bytes per block
_ASSIGN, _ADD, _NONE = 0, 1, 2  # what the kernel does with acc
ZERO, EIGHT = np.float32(0.0), np.float32(8.0)  # float32 constants: no float64 creeps in


class Kernels(NamedTuple):
    q4_sum: Callable[..., float]  # (scales, codes, n, acc, w, mode) -> Σ values²
    # (theta, m, g, divisor, lr, mu, lr·w, divide?, scale?, momentum?) -> finite?
    step: Callable[..., bool]
    median: Callable[..., None]  # (rows k × n, comparators m × 2, out n) -> None


# the numba kernel once built; False when numba is missing or refused
_compiled: Kernels | Literal[False] | None = None
_Jit = Callable[[Callable[..., Any]], Callable[..., Any]]  # numba.njit(...)


def backend() -> str:
    """"numba" when the compiled kernel runs, else "numpy" (`YETO_KERNELS=numpy` forces
    the twin, for a comparison)."""
    return "numba" if _kernel() else "numpy"


@contextlib.contextmanager
def using(name: str) -> Iterator[None]:
    """Inside the block, sum and step with `name`: "numpy" (the twin) or "auto" (the
    compiled pass when numba is installed, as outside). Tests and benchmarks compare
    the two this way; the syncer never calls it (`YETO_KERNELS=numpy` forces the twin)."""
    global _compiled
    if name not in ("auto", "numpy"):
        raise ValueError(f"kernels: {name!r} is neither 'auto' nor 'numpy'")
    saved = _compiled
    _compiled = False if name == "numpy" else (saved or None)  # (None: built on use)
    try:
        yield
    finally:
        _compiled = saved


def describe() -> str:
    """What will sum q4 pushes, for the syncer's start-up log (nothing is built here:
    the kernels compile on the first push, or load from numba's cache)."""
    if os.environ.get("YETO_KERNELS") != "numpy" and importlib.util.find_spec("numba"):
        return "one compiled pass (numba)"
    return ("numpy (pip install 'yeto[fast]' for the compiled pass: a push summed in "
            "about half the time)")


def q4_add_square(scales: np.ndarray, codes: fmt.Payload, n: int, acc: np.ndarray | None,
                  weight: np.float32, assign: bool) -> float:
    """For the first `n` values of whole q4 blocks (`scales`: float32, validated;
    `codes`: uint8, HALF per block): acc += weight * values (`assign`: acc = 0 + ...;
    acc None: nothing summed), and return Σ values² as this module defines it."""
    codes = np.frombuffer(codes, np.uint8) if not isinstance(codes, np.ndarray) else codes
    nb = -(-n // Q4_BLOCK)
    if scales.size < nb or codes.size < nb * HALF or (acc is not None and acc.size < n):
        raise ValueError(f"q4 chunk of {n} values needs {nb} scales and {nb * HALF} code "
                         f"bytes, got {scales.size} and {codes.size}")
    mode = _NONE if acc is None else _ASSIGN if assign else _ADD
    out = np.empty(0, np.float32) if acc is None else acc
    kernel = _kernel()
    if kernel:
        return float(kernel.q4_sum(scales, codes, n, out, np.float32(weight), mode))
    return _numpy_twin(scales, codes, n, out, np.float32(weight), mode)


def outer_step(theta: np.ndarray, m: np.ndarray | None, g: np.ndarray, lr: float, mu: float,
               w: float, divisor: float = 1.0) -> bool:
    """The outer step, in place, in one pass: with x = g / divisor, m ← μm + x and Θ ← Θ −
    lr·x − (lr·w)·m (m None: Θ ← Θ − lr·x), each operation rounded to float32 as
    `syncer.strategy.Nesterov` writes it in numpy (÷ 1 and × 1 skipped: they change no
    bit). g is scratch (the twin divides it in place). Any length: one call, one
    release of the GIL. Returns whether Θ and m came out finite."""
    kernel = _kernel()
    if not kernel:
        ok = True
        for lo in range(0, theta.size, fmt.CHUNK):
            hi = min(lo + fmt.CHUNK, theta.size)
            ok &= _outer_twin(theta[lo:hi], None if m is None else m[lo:hi], g[lo:hi],
                              lr, mu, w, divisor)
        return ok
    return bool(kernel.step(theta, np.empty(0, np.float32) if m is None else m, g,
                            np.float32(divisor), np.float32(lr), np.float32(mu),
                            np.float32(lr * w), divisor != 1.0, lr != 1.0, m is not None))


def _outer_twin(theta: np.ndarray, m: np.ndarray | None, g: np.ndarray, lr: float, mu: float,
                w: float, divisor: float) -> bool:
    """One cache-sized chunk of `outer_step` in numpy."""
    if divisor != 1.0:
        np.divide(g, np.float32(divisor), out=g)
    if m is not None:
        m *= np.float32(mu)
        m += g
    if lr != 1.0:
        g *= np.float32(lr)
    theta -= g
    if m is not None:
        np.multiply(m, np.float32(lr * w), out=g)
        theta -= g
    return bool(np.isfinite(theta).all() and (m is None or np.isfinite(m).all()))


_ONES = np.ones(Q4_BLOCK, np.float32)


def _numpy_twin(scales: np.ndarray, codes: np.ndarray, n: int, acc: np.ndarray,
                weight: np.float32, mode: int) -> float:
    """`q4_add_square` in numpy: the kernel's bits (the sum is the codec's own decode)."""
    nb = -(-n // Q4_BLOCK)
    with fmt.spare_scratch() as k:
        d = fmt.q4_centered(codes[:nb * HALF], k)
        d[n:] = 0  # the last block's padding counts for nothing
        squares = np.square(d, out=k.wide[:d.size])  # small integers: their block sums
        isum = squares.reshape(nb, Q4_BLOCK) @ _ONES  # (<= 4096) are exact in any order
        s = scales[:nb].astype(np.float64)
        sq = float(np.cumsum(s * s * isum)[-1]) if nb else 0.0
        if mode != _NONE:
            v = fmt.times_scales(d, scales[:nb], k, d)[:n]
            v *= weight
            fmt.add_to(acc[:n], v, mode == _ASSIGN)
    return sq


def _kernel() -> Kernels | Literal[False]:
    global _compiled
    if _compiled is None:
        _compiled = False if os.environ.get("YETO_KERNELS") == "numpy" else _build()
    return _compiled


def _build() -> Kernels | Literal[False]:
    """The numba kernel, or False without numba. Compiled on first use (about half a
    second, cached on disk by numba after that)."""
    try:
        import numba
    except ImportError:
        return False
    # no fastmath: every operation rounds as numpy's does, none is fused or reordered
    opts: dict[str, Any] = dict(nogil=True, boundscheck=False, error_model="numpy")
    try:
        jit = numba.njit(cache=True, **opts)
        jit(_cacheable)  # raises where numba finds nowhere to write its cache
    except RuntimeError:
        jit = numba.njit(**opts)

    return Kernels(_q4_sum(jit), _step(jit), _median(jit))


def _q4_sum(jit: _Jit) -> Callable[..., float]:
    """The q4 sum's kernel, compiled by `jit`."""

    @jit
    def q4_sum(scales: np.ndarray, codes: np.ndarray, n: int, acc: np.ndarray, w: np.float32,
               mode: int) -> float:
        sq = 0.0
        isum: int | np.signedinteger[Any]  # (a declaration: no bytecode for numba)
        for b in range(n // 64):  # whole blocks
            s, o, c0, isum = scales[b], b * 64, b * 32, 0
            for j in range(32):  # Σ (code - 8)², an exact integer
                c = np.int32(codes[c0 + j])
                d0, d1 = (c & 15) - 8, (c >> 4) - 8
                isum += d0 * d0 + d1 * d1
            sq += np.float64(s) * np.float64(s) * isum
            if mode == 0:  # each loop apart, so that it is vectorised
                for j in range(32):
                    c = codes[c0 + j]
                    acc[o + 2 * j] = ZERO + (np.float32(c & 15) - EIGHT) * s * w
                    acc[o + 2 * j + 1] = ZERO + (np.float32(c >> 4) - EIGHT) * s * w
            elif mode == 1:
                for j in range(32):
                    c = codes[c0 + j]
                    acc[o + 2 * j] += (np.float32(c & 15) - EIGHT) * s * w
                    acc[o + 2 * j + 1] += (np.float32(c >> 4) - EIGHT) * s * w
        if n % 64:  # the last block, cut short: value by value
            b, isum = n // 64, 0
            for i in range(b * 64, n):
                c = np.int32(codes[i // 2])
                d = ((c >> 4) if i & 1 else (c & 15)) - 8
                isum += d * d
                v = np.float32(d) * scales[b] * w
                if mode == 0:
                    acc[i] = ZERO + v
                elif mode == 1:
                    acc[i] += v
            sq += np.float64(scales[b]) * np.float64(scales[b]) * isum
        return sq

    return q4_sum


def _step(jit: _Jit) -> Callable[..., bool]:
    """The outer step's kernel, compiled by `jit`."""

    @jit
    def step(theta: np.ndarray, m: np.ndarray, g: np.ndarray, d: np.float32, lr: np.float32,
             mu: np.float32, lrw: np.float32, divide: bool, scale: bool, momentum: bool) -> bool:
        ok = True
        for i in range(theta.size):
            gi = g[i] / d if divide else g[i]
            x = gi * lr if scale else gi
            t = theta[i] - x
            if momentum:
                mi = m[i] * mu + gi
                m[i] = mi
                t = t - mi * lrw
                ok &= np.isfinite(mi)
            theta[i] = t
            ok &= np.isfinite(t)
        return ok

    return step


def _median(jit: _Jit) -> Callable[..., None]:
    """The column median's kernel, compiled by `jit`: `sort_columns`' network applied to
    256 columns at a time, copied into a small buffer that stays in the cache (each
    comparator a vectorised min/max over the block's columns)."""

    @jit
    def median(rows: np.ndarray, comparators: np.ndarray, out: np.ndarray) -> None:
        k, n = rows.shape
        block = 256
        buf = np.empty((k, block), np.float32)
        for lo in range(0, n, block):
            hi = min(lo + block, n)
            w = hi - lo
            for i in range(k):
                for j in range(w):
                    buf[i, j] = rows[i, lo + j]
            for c in range(comparators.shape[0]):
                a, b = comparators[c, 0], comparators[c, 1]
                for j in range(w):
                    x, y = buf[a, j], buf[b, j]
                    buf[a, j] = min(x, y)
                    buf[b, j] = max(x, y)
            for j in range(w):
                if k % 2:
                    out[lo + j] = buf[k // 2, j]
                else:
                    out[lo + j] = (buf[k // 2 - 1, j] + buf[k // 2, j]) * np.float32(0.5)

    return median


def column_median(rows: np.ndarray) -> np.ndarray:
    """The median of each column of `rows` (k × n float32, finite; k ≥ 1): one compiled
    pass, or the numpy twin (a sorted copy by `sort_columns`), with the same bits."""
    k = rows.shape[0]
    out = np.empty(rows.shape[1], np.float32)
    kernel = _kernel()
    if kernel:
        pairs = np.array(_comparators(k) or ((0, 0),), np.int64).reshape(-1, 2)
        kernel.median(np.ascontiguousarray(rows, np.float32), pairs, out)
        return out
    s = rows.astype(np.float32, copy=True)
    sort_columns(s)
    if k % 2:
        out[...] = s[k // 2]
    else:
        np.multiply(s[k // 2 - 1] + s[k // 2], np.float32(0.5), out=out)
    return out


@functools.cache
def _comparators(k: int) -> tuple[tuple[int, int], ...]:
    """Batcher's odd-even merge sort (Knuth, TAOCP vol. 3, §5.3.4) for the next power
    of two ≥ k, without the comparators that touch a row past k (rows of +∞ there
    would never move): a sorting network for k rows."""
    n = 1 << max(0, (k - 1).bit_length())
    out, p = [], 1
    while p < n:
        q = p
        while q >= 1:
            for j in range(q % p, n - q, 2 * q):
                for i in range(min(q, n - j - q)):
                    a, b = i + j, i + j + q
                    if a // (2 * p) == b // (2 * p) and b < k:
                        out.append((a, b))
            q //= 2
        p *= 2
    return tuple(out)


def sort_columns(rows: np.ndarray) -> None:
    """Sort each column of `rows` (k × n, k small: the islands of a round; finite) in
    place, by a sorting network of whole-row minimum and maximum passes: the order of
    `rows.sort(axis=0)`, 5× faster at k = 16 than numpy's sort along the short axis."""
    low = np.empty_like(rows[0])
    for a, b in _comparators(rows.shape[0]):
        np.minimum(rows[a], rows[b], out=low)
        np.maximum(rows[a], rows[b], out=rows[b])
        rows[a] = low


def _cacheable() -> None:
    """A function numba is asked to cache, to learn whether it can."""
