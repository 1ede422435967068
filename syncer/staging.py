"""A push summed into its round as its bytes arrive, folded in at its last byte.

The first push of a round (nothing summed yet: the sum buffer is "fresh", which every
reader of the round takes as holding nothing) is decoded chunk by chunk straight into
the round's sum buffer while it streams in (`StagedSum`, the `into` of the push's
`yeto.codec.receiver.PayloadReceiver`, so each piece is validated before it is
summed): that buffer is the push's staging area. At its last byte, once the run has
accepted it (caller, round, duplicates, staleness: `syncer.run.Run.push`), it is
folded in at once (`MergeAccumulator.add`: its norm is known from the chunks' squares,
the norm bound scales it, and the buffer stops being fresh). A push broken mid-stream
(short, overlong, a bad value, the island gone) or refused at its end lets the buffer
go still fresh: the round's state is what it was, bit for bit (`syncer.run.Run.state_digest`
reads no fresh sum), and the next push overwrites it.

The staged push's bytes also go where a whole push's would (its spill file or pooled
buffer). The other pushes of the round arrive whole there and are summed at their
last byte as before; one that completes while a push still stages into its round
does not wait for it (a silent island would hold the round): it takes the buffer, and
the staged push goes on as a whole one (`demote`), summed from its own bytes at its
last byte. No round commits while a push stages into it: it has no responder yet. So
the round's sum is, bit for bit, the sum of the whole payloads in the order the run
accepted them (a staged push in range assigns w·Δ exactly as the first whole push
would), and memory is unchanged: no push is held decoded beside the sum.

Pushes that arrive together race to their last byte, and a stager that loses throws
its decode so far away; so a push stages only when it starts alone (no other push of
its fragment arriving), and one that starts beside a stager not yet half in takes it
off the buffer at once (`Arrivals`, `syncer.rounds.Rounds.make_way`).

Not staged: seeds, rounds that keep their pushes until the commit (`--clip-factor`, a
share cap),
pushes with 0 loss tokens (their weight depends on the pushes after them), a round
whose sum is not fresh, any push while a commit waits for its save, or one that
starts while the run's lock is held (a commit saving its state: the push does not
wait for it to start arriving)."""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterator
from typing import Protocol, TypeAlias

import numpy as np

from syncer.messages import PushHeader
from yeto.codec import CHUNK, Q4_BLOCK, CodecError
from yeto.codec import format as fmt
from yeto.codec.buffers import SpilledPayload
from yeto.codec.chunked import ITEM, decode_add_square, q4_add_square
from yeto.codec.format import Payload


class Sums(Protocol):
    """What a staged push sums into (`syncer.merge.MergeAccumulator`)."""

    staging: StagedSum | None

    def staging_buffer(self) -> np.ndarray: ...

    def unstage(self, demote: bool = False) -> None: ...


class StagedSum:
    """A push of `numel` values in `encoding`, decoded as its bytes arrive into `acc`'s
    sum buffer with weight `weight` (assigned: the buffer holds nothing yet), its bytes
    kept in `keep` too (a `SpilledPayload`, or a uint8 array of the payload's size).
    A chunk of values that lies whole in an arriving piece is decoded from the piece
    itself; one split between pieces is gathered in `pending` (one chunk's bytes,
    made once) and decoded from there. q4 block scales are read back from `keep`.
    Keeps Σ of the chunks' squared values for the push's norm."""

    def __init__(self, acc: Sums, encoding: str, numel: int, weight: float,
                 keep: SpilledPayload | np.ndarray):
        self.acc, self.encoding, self.numel, self.keep = acc, encoding, numel, keep
        self.lock = threading.Lock()  # one chunk's decode, or the demotion
        self.demoted = False  # another push took the buffer: this one is a whole push
        self.weight = np.float32(weight)
        self.size = fmt.encoded_size(encoding, numel)
        self.head = 4 * -(-numel // Q4_BLOCK) if encoding == "q4" else 0
        self.buf = acc.staging_buffer()
        self.pending = np.empty(self._body_bytes(0, min(CHUNK, numel)), np.uint8)
        self.held = 0              # bytes of the next chunk gathered in `pending`
        self.n = self.lo = 0       # bytes received; values decoded
        self.squares = 0.0         # Σ over decoded chunks of Σ v², in chunk order

    def __len__(self) -> int:
        return self.size

    def write(self, piece: Payload) -> None:
        """The next bytes of the payload (validated by the receiver): kept, and every
        chunk of values they complete is decoded into the sum buffer."""
        view = fmt.as_view(piece).cast("B")
        if isinstance(self.keep, np.ndarray):
            self.keep[self.n:self.n + len(view)] = np.frombuffer(view, np.uint8)
        else:
            self.keep.write(view)
        with self.lock:
            if not self.demoted:
                self._stage(view)
            else:
                self.n += len(view)

    def payload(self) -> SpilledPayload | np.ndarray:
        """The push's bytes as received (summed whole, once demoted)."""
        return self.keep

    def demote(self) -> None:
        """Another push takes the sum buffer: stop decoding into it."""
        with self.lock:
            self.demoted = True

    def _stage(self, view: memoryview) -> None:
        if self.n < self.head:  # q4 block scales: read back from `keep` when needed
            take = min(len(view), self.head - self.n)
            view, self.n = view[take:], self.n + take
        self.n += len(view)
        while self.lo < self.numel and len(view):
            hi = min(self.lo + CHUNK, self.numel)
            need = self._body_bytes(self.lo, hi)
            if not self.held and len(view) >= need:  # whole in this piece
                self._decode(self.lo, hi, view[:need])
                view = view[need:]
            else:  # split between pieces: gathered first
                take = min(need - self.held, len(view))
                self.pending[self.held:self.held + take] = np.frombuffer(view[:take], np.uint8)
                self.held += take
                view = view[take:]
                if self.held < need:
                    return
                self.held = 0
                self._decode(self.lo, hi, self.pending[:need])
            self.lo = hi

    def _body_bytes(self, lo: int, hi: int) -> int:
        if self.encoding == "q4":
            return (-(-hi // Q4_BLOCK) - lo // Q4_BLOCK) * (Q4_BLOCK // 2)
        return ITEM[self.encoding] * (hi - lo)

    def _decode(self, lo: int, hi: int, body: Payload) -> None:
        if self.encoding != "q4":
            self.squares += decode_add_square(body, self.encoding, hi - lo, self.buf[lo:hi],
                                              self.weight, assign=True)
            return
        part = slice(4 * (lo // Q4_BLOCK), 4 * -(-hi // Q4_BLOCK))
        scales: Payload = (self.keep[part] if isinstance(self.keep, np.ndarray)
                           else self.keep.read(part))
        self.squares += q4_add_square(scales, body, hi - lo, self.buf[lo:hi], self.weight, True)

    def fold(self, norm_limit: float | None) -> tuple[float, float]:
        """The push is accepted: (its norm, the norm bound's scale); a push over the
        bound is scaled down in the buffer. Raises CodecError if it is not whole."""
        if self.lo != self.numel:
            raise CodecError(f"push ended after {self.lo} of {self.numel} values")
        norm = float(np.sqrt(self.squares))
        scale = norm_limit / norm if norm_limit is not None and norm > norm_limit else 1.0
        if scale < 1.0:
            for lo in range(0, self.numel, CHUNK):
                self.buf[lo:lo + CHUNK] *= np.float32(scale)
        return norm, scale


class Arrivals:
    """The delta pushes arriving now, per fragment. A push that arrives alone may stage
    (`claim`); one that starts beside others does not, and takes the round's stager off
    the buffer at once if it is not half in yet (`make_way`). Pushes that arrive
    together race: the first to end takes the buffer from a stager, and the stager's
    decode so far is lost (two islands pushing at once would do so every round).
    Which path a push takes is all this decides, never the
    bits of the sum."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count: dict[int, int] = {}

    @contextlib.contextmanager
    def arriving(self, h: PushHeader) -> Iterator[bool]:
        """For the length of push `h`'s stream: yields whether it arrives alone (no
        other delta push of its fragment arriving when it starts)."""
        if h.seed:
            yield True
            return
        with self._lock:
            others = self._count.get(h.fragment, 0)
            self._count[h.fragment] = others + 1
        try:
            yield others == 0
        finally:
            with self._lock:
                self._count[h.fragment] -= 1


class OwnedSeed:
    """A seed as a shard receives it (`syncer.model.Model.seed_target`): every byte
    hashed as it arrives (the digest the seeding island declared covers all of Θ), and
    only the bytes of the shard's own fragments kept, in a Θ-shaped array whose other
    pages are never written, so they take no memory (`np.zeros` maps pages on first
    write). A shard of S holds its part of Θ from the seed's first byte, never the
    whole. The receiver has checked every value before `write` sees it."""

    def __init__(self, numel: int, spans: list[tuple[int, int]]):
        self.theta = np.zeros(numel, np.float32)
        self._bytes = self.theta.view(np.uint8)
        self._ranges = [(4 * lo, 4 * hi) for lo, hi in spans]  # bytes kept
        self._hash = hashlib.sha256()
        self._n = 0  # bytes received

    def __len__(self) -> int:
        return self._bytes.size

    def write(self, piece: Payload) -> None:
        view = fmt.as_view(piece).cast("B")
        self._hash.update(view)
        start, end = self._n, self._n + len(view)
        for lo, hi in self._ranges:
            a, b = max(lo, start), min(hi, end)
            if a < b:
                self._bytes[a:b] = np.frombuffer(view[a - start:b - start], np.uint8)
        self._n = end

    def digest(self) -> bytes:
        """SHA-256 of every byte received (all of Θ, not only the kept part)."""
        return self._hash.digest()


# a delta as the run takes it: its bytes in memory, spilled to a file, or staged
Pushed: TypeAlias = Payload | SpilledPayload | StagedSum
# any push as it was received (a shard receives a seed as an `OwnedSeed`)
Received: TypeAlias = Pushed | OwnedSeed
# where a push's bytes go as they arrive, before the run takes it (`PushBody.receive`)
Into: TypeAlias = StagedSum | SpilledPayload | OwnedSeed | np.ndarray | None


class PushBody(Protocol):
    """One push's stream as `syncer.run.Run.push` receives it, once its header passed:
    the transport (`syncer.service`) owns the slots, the buffers and the bytes; the run
    decides, in this order, whether the push may take a slot, where its bytes go
    (kept, staged into its round, or a pooled buffer) and what it makes of them."""

    def slot(self) -> contextlib.AbstractContextManager[None]:
        """Hold one of the pushes-in-flight slots while the body is received."""

    def buffer(self, h: PushHeader, keep: bool
               ) -> contextlib.AbstractContextManager[SpilledPayload | np.ndarray | None]:
        """Where push `h`'s bytes go (None: a new buffer); `keep`: the run keeps them."""

    def arriving(self, h: PushHeader) -> contextlib.AbstractContextManager[bool]:
        """For the length of the stream: whether push `h` arrives alone (`Arrivals`)."""

    def receive(self, h: PushHeader, into: Into, max_abs: float) -> Received:
        """The payload, every byte of it validated (finite, within `max_abs`)."""


class WholePush:
    """A push already whole in memory (`PushBody`): for a run driven in-process, as
    the fleet model and its tests do; no slot, no staging, and its values taken as
    they are (nothing crossed a process boundary)."""

    def __init__(self, payload: Payload) -> None:
        self._payload = payload

    def slot(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def buffer(self, h: PushHeader, keep: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def arriving(self, h: PushHeader) -> contextlib.AbstractContextManager[bool]:
        return contextlib.nullcontext(True)  # alone, and no buffer: never staged

    def receive(self, h: PushHeader, into: Into, max_abs: float) -> Received:
        return self._payload
