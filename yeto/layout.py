"""Canonical tensor layout, fragments and the layout fingerprint.

Every island describes its trainable tensors as an ordered list of
(canonical name, shape, dtype). The order is the *natural sort* of the names
(numbers compared as numbers: layers.2 < layers.10), so torch and MLX islands get
the same order whatever their module trees iterate in.

All trainable tensors are viewed as one flat float32 vector in that order; a
fragment is a contiguous range of whole tensors in it. Fragments and the
fingerprint depend only on names, shapes and integers, never on floating point or
hash seeds, so every machine cuts the same fragments.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


class LayoutMismatch(ValueError):
    """Two layouts that should be identical are not."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def numel(self) -> int:
        return math.prod(int(d) for d in self.shape)  # Python ints: no int64 wrap-around


@dataclass(frozen=True)
class Fragment:
    index: int
    start: int  # offset into the flat vector, in elements
    stop: int
    tensors: tuple[str, ...]

    @property
    def numel(self) -> int:
        return self.stop - self.start


def natural_key(name: str) -> tuple[int | str, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def canonical_order(names: Iterable[str]) -> list[str]:
    return sorted(names, key=natural_key)


class Layout:
    """Ordered tensor specs, their offsets in the flat vector, and P fragments."""

    def __init__(self, specs: list[TensorSpec], num_fragments: int = 1):
        if not specs:
            raise LayoutMismatch("empty layout: no trainable tensors were found")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise LayoutMismatch("duplicate tensor names in layout")
        if names != canonical_order(names):
            raise LayoutMismatch("layout is not in canonical (natural-sort) order; "
                                 "build it with Layout.from_shapes()")
        if not 1 <= num_fragments <= len(specs):
            raise ValueError(f"num_fragments must be in 1..{len(specs)}, got {num_fragments}")
        self.specs = list(specs)
        self.offsets: dict[str, tuple[int, int]] = {}
        pos = 0
        for s in self.specs:
            self.offsets[s.name] = (pos, pos + s.numel)
            pos += s.numel
        self.numel = pos
        self.fragments = _cut(self.specs, num_fragments)
        self.fingerprint = fingerprint(self.specs)

    @classmethod
    def from_shapes(cls, shapes: dict[str, tuple[int, ...]], dtype: str = "float32",
                    num_fragments: int = 1) -> Layout:
        specs = [TensorSpec(n, tuple(int(d) for d in shapes[n]), dtype)
                 for n in canonical_order(shapes)]
        return cls(specs, num_fragments)

    def with_fragments(self, num_fragments: int) -> Layout:
        return Layout(self.specs, num_fragments)

    def flatten(self, tensors: dict[str, np.ndarray]) -> np.ndarray:
        """Concatenate named arrays into the flat float32 vector (validating shapes)."""
        out = np.empty(self.numel, dtype=np.float32)
        for s in self.specs:
            a = tensors.get(s.name)
            if a is None:
                raise LayoutMismatch(f"tensor {s.name} is missing")
            if tuple(a.shape) != s.shape:
                raise LayoutMismatch(f"tensor {s.name}: shape {tuple(a.shape)}, "
                                     f"layout says {s.shape}")
            lo, hi = self.offsets[s.name]
            out[lo:hi] = np.asarray(a, dtype=np.float32).reshape(-1)
        return out

    def unflatten(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Views of the flat vector as named arrays (no copy)."""
        if flat.shape != (self.numel,):
            raise LayoutMismatch(f"flat vector has {flat.size} elements, layout has {self.numel}")
        return {s.name: flat[slice(*self.offsets[s.name])].reshape(s.shape) for s in self.specs}

    def check_same(self, other: Layout) -> None:
        """Raise LayoutMismatch naming the first differing tensor."""
        if self.fingerprint == other.fingerprint:
            return
        raise LayoutMismatch(describe_mismatch(self.specs, other.specs))


def describe_mismatch(mine: list[TensorSpec], theirs: list[TensorSpec]) -> str:
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return (f"layouts differ at tensor #{i}: run has {a.name} {list(a.shape)} {a.dtype}, "
                    f"island has {b.name} {list(b.shape)} {b.dtype}")
    if len(mine) != len(theirs):
        longer, who = (mine, "run") if len(mine) > len(theirs) else (theirs, "island")
        extra = longer[min(len(mine), len(theirs))]
        return (f"layouts differ in length: run has {len(mine)} tensors, island has "
                f"{len(theirs)}; first extra on the {who}'s side: {extra.name} {list(extra.shape)}")
    return "layouts differ"


def fingerprint(specs: list[TensorSpec]) -> str:
    """SHA-256 over a plain-text rendering: stable across Python and numpy versions."""
    h = hashlib.sha256()
    for s in specs:
        h.update(f"{s.name}|{','.join(map(str, s.shape))}|{s.dtype}\n".encode())
    return h.hexdigest()


def _cut(specs: list[TensorSpec], parts: int) -> list[Fragment]:
    """Contiguous, size-balanced cut: fragment k ends at the first tensor boundary
    at or past k/P of the total (integer arithmetic only)."""
    total = sum(s.numel for s in specs)
    frags: list[Fragment] = []
    start_i, start_pos, pos = 0, 0, 0
    for i, s in enumerate(specs):
        pos += s.numel
        k = len(frags) + 1
        remaining_tensors = len(specs) - i - 1
        must_leave = parts - k  # fragments still to fill need >= 1 tensor each
        if k < parts and (pos * parts >= k * total or remaining_tensors == must_leave):
            if remaining_tensors >= must_leave:
                frags.append(Fragment(len(frags), start_pos, pos,
                                      tuple(x.name for x in specs[start_i:i + 1])))
                start_i, start_pos = i + 1, pos
    frags.append(Fragment(len(frags), start_pos, pos, tuple(x.name for x in specs[start_i:])))
    return frags
