"""The island's applier: a received Θ into the weights and the anchor, chunk by chunk
(as it streams in), at a step boundary.

Training overlaps the round trip, so when Θ arrives the island keeps the steps it made
since its push: local ← Θ + (local − anchor), anchor ← Θ. `merge_alpha` α mixes
instead: local ← α·local + (1 − α)·(Θ + local − anchor); α = 0 (the default) keeps
nothing of the pre-merge local weights but the steps the merge could not have seen.
The first Θ an island receives is adopted with α = 0 (all islands start on it), and
the final Θ replaces the local weights exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np

from yeto import codec
from yeto.codec.chunked import ranges
from yeto.island.encoder import DeltaEncoder
from yeto.layout import Fragment
from yeto.transport import Lost, Received, ThetaStream, TransportError

log = logging.getLogger("yeto.island")


class Applier:
    """Applies broadcasts through an open pass over the weights; moves `encoder`'s
    anchor to Θ. A fragment whose last broadcast broke off (`partial`) takes its next
    broadcast whatever the version."""

    def __init__(self, encoder: DeltaEncoder, merge_alpha: float, chunk: int):
        self.encoder, self.merge_alpha, self.chunk = encoder, float(merge_alpha), chunk
        self.partial: set[int] = set()

    def wanted(self, got: Received, held: int | None) -> bool:
        """Whether `got` brings anything new over version `held` of its fragment (a
        rejoin re-sends the current Θ); an unwanted stream is discarded."""
        if got.version == held and not got.final and got.fragment not in self.partial:
            if isinstance(got.theta, ThetaStream):
                got.theta.discard()
            return False
        return True

    def apply(self, got: Received, frag: Fragment, w, first: bool) -> bool:
        """Θ into the model and the anchor, chunk by chunk (as it streams in). False when
        a streamed broadcast broke off: the chunks applied stay applied (each as a whole
        apply would have done it), and the fragment's next broadcast is applied whatever
        its version. `first`: the island's first Θ of this fragment (adopted as is)."""
        alpha = 0.0 if first else self.merge_alpha
        anchor = self.encoder.anchor
        self.partial.add(got.fragment)
        scratch = np.empty(min(self.chunk, frag.numel), np.float32)  # reused by every piece
        try:
            for lo, theta in _pieces(got.theta, frag, self.chunk):
                hi = lo + theta.size
                if got.final:
                    w.write(lo, hi, theta)
                    anchor[lo:hi] = theta
                else:
                    w.write(lo, hi, self._merge(w.read(lo, hi), lo, theta, alpha, scratch))
        except TransportError as e:
            log.warning("broadcast of fragment %d (version %d) broke off: %s; its next "
                        "broadcast is applied whatever its version", got.fragment,
                        got.version, e)
            return False
        self.partial.discard(got.fragment)
        return True

    def _merge(self, local: np.ndarray, lo: int, theta: np.ndarray, alpha: float,
               scratch: np.ndarray) -> np.ndarray:
        """Θ + (local − anchor) (the island's own steps kept) for values [lo, lo + len(Θ)),
        and the anchor moved to Θ, a q4 chunk at a time (in the CPU cache). The sum goes
        into `local` itself when it can (what `read_range` returns is the island's to
        change), so a backend whose read is a view of its weights copies nothing."""
        anchor = self.encoder.anchor
        in_place = not alpha and local.flags.writeable
        out = local if in_place else scratch[:theta.size]
        for a, b in ranges(0, theta.size, codec.CHUNK):
            m = np.subtract(local[a:b], anchor[lo + a:lo + b], out=out[a:b])
            m += theta[a:b]
            if alpha:
                m[...] = alpha * local[a:b] + (1 - alpha) * m
            anchor[lo + a:lo + b] = theta[a:b]
        return out


def _pieces(theta, frag: Fragment, chunk: int) -> Iterator[tuple[int, np.ndarray]]:
    """(flat offset, values) pieces of a fragment's Θ, whole or streamed, none longer
    than `chunk`."""
    if isinstance(theta, ThetaStream):
        if theta.numel != frag.numel:
            theta.discard()
            raise Lost(f"broadcast of {theta.numel} values for a fragment of {frag.numel}")
        pieces = theta.pieces()
    else:
        pieces = iter((np.asarray(theta, dtype=np.float32),))
    pos = frag.start
    for piece in pieces:
        if pos + piece.size > frag.stop:
            raise Lost("broadcast longer than its fragment")
        for lo, hi in ranges(0, piece.size, chunk):
            yield pos + lo, piece[lo:hi]
        pos += piece.size
