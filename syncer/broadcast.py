"""Broadcast: what the syncer sends islands, and each island's stream of it.

`Downlink` makes each fragment's next broadcast from Θ (whole, or a compressed
update against what islands hold); `Source` serves its bytes to every stream
without a copy of Θ; `Subscription` is one island's stream: each new version once,
as the compressed update when it holds that update's base version.

A stream still sending an older version when Θ changes keeps that version's bytes
alive: one copy per version, shared by all of its streams, and at most
`Downlink.KEPT` older versions per fragment. A stream that falls further behind (a
stalled or hostile reader) is ended instead of costing another copy of Θ; its island
reconnects and is sent the newest version.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np

from syncer.errors import Reject
from syncer.stepping import Filling
from yeto import net, wire
from yeto.codec import chunked
from yeto.proto import yeto_pb2 as pb

if TYPE_CHECKING:
    from syncer.config import Config
    from syncer.members import Member

log = logging.getLogger("syncer")
T = TypeVar("T")


class Sink(Protocol):
    """Where a direct-downlink stream writes (`syncer.direct.DirectStream`): a header,
    then exactly its payload's bytes."""

    def send_header(self, header: pb.BroadcastHeader) -> None:
        """Send a broadcast's header frame; its payload_bytes follow."""

    def send_all(self, data: bytes | memoryview) -> None:
        """Send all of `data` (waiting, bounded, while the peer catches up)."""

    def send_some(self, view: memoryview) -> int:
        """Bytes of `view` the kernel took at once (0: none now); never waits."""

    def wait_writable(self) -> None:
        """Wait until the peer may take more, or a while (a second at most)."""


class Source:
    """The f32 bytes a broadcast streams to islands that need the whole fragment: a
    view of the live weights (Θ, or the islands' weights under a compressed
    downlink), not a copy. Before a commit changes those weights it calls `detach`:
    the part that streams still in progress have not sent yet is copied, so they
    finish with the version they started (nothing is copied when none is in
    progress, the usual case); a source with no reader is retired, and a detached one
    frees its copy when its last reader closes, or when `retire` ends its readers
    (`Downlink.KEPT`). A chunk built for one reader is kept for the others until they
    have all passed it (at most `SHARED` chunks): islands streaming in step share one
    copy per chunk. A reader on the direct downlink (`stream_to`) builds nothing: the
    kernel copies from the weights themselves, each piece pinned while it does, and
    `detach` waits for those pins (a non-blocking send each) before the weights change."""

    SHARED = 2  # chunks kept for readers behind (each net.CHUNK_BYTES at most)
    PIECE = 4 << 20  # the most one non-blocking send of `stream_to` is offered

    def __init__(self, array: np.ndarray, filling: Filling | None = None):
        self._array: np.ndarray | None = array.view(np.uint8).reshape(-1)
        self.size = self._array.size
        self._offset = 0              # byte of the whole payload at self._array[0]
        self._live = True
        self._readers: dict[int, int] = {}  # reader -> the next byte it reads
        self._next = 0
        # (lo, hi, prefix) -> the chunk built for a reader, kept for the others
        self._built: collections.OrderedDict[tuple[int, int, bytes], bytes] = (
            collections.OrderedDict())
        self._lock = threading.Lock()
        self._unpinned = threading.Condition(self._lock)
        self._pins = 0  # sends in progress from the live weights (`stream_to`)
        self.filling = filling  # the bytes not yet written (an outer step behind it)
        self._retired = ""  # why its readers were ended (`retire`)

    def open(self) -> int:
        with self._lock:
            if self._array is None:
                raise RuntimeError("broadcast source retired before it was read")
            self._next += 1
            self._readers[self._next] = 0
            return self._next

    def read(self, reader: int, lo: int, hi: int, prefix: bytes = b"") -> bytes:
        """`prefix` + bytes [lo, hi) of the payload as one bytes object: built anew, or
        the one just built for another reader (islands streaming in step share it);
        with a `filling`, once those bytes are final."""
        if self.filling is not None:
            self.filling.wait(hi)
        with self._lock:
            if self._retired:
                raise Reject("exhausted", self._retired)
            self._readers[reader] = hi
            key = (lo, hi, prefix)
            data = self._built.get(key)
            if data is None:
                a = self._held()[lo - self._offset:hi - self._offset]
                data = self._built[key] = b"".join((prefix, a.data))
            self._forget_passed()
            while len(self._built) > self.SHARED:
                self._built.popitem(last=False)
            return data

    def stream_to(self, reader: int, sink: Sink) -> None:
        """Hand the whole payload to `sink` from the bytes themselves: a view of each
        piece, pinned for one non-blocking `sink.send_some` (while the weights are live,
        `detach` waits for it: a copy into the kernel, never a wait on the peer); when
        the peer takes nothing, `sink.wait_writable` (bounded) and again. With a
        `filling`, each piece once its bytes are final. Raises Reject once retired."""
        pos = 0
        while pos < self.size:
            hi = min((pos // self.PIECE + 1) * self.PIECE, self.size)  # (after a part sent:
            # the rest of its piece, not another piece's worth, so no more waits for a filling)
            if self.filling is not None:
                self.filling.wait(hi)
            view, pinned = self._pin(pos, hi)
            sent = 0
            try:
                sent = sink.send_some(view)
            finally:
                self._unpin(reader, pinned, pos + sent)
            pos += sent
            if not sent:
                sink.wait_writable()

    def _pin(self, lo: int, hi: int) -> tuple[memoryview, bool]:
        """A view of bytes [lo, hi), and whether it pins the live weights."""
        with self._lock:
            if self._retired:
                raise Reject("exhausted", self._retired)
            view = self._held()[lo - self._offset:hi - self._offset].data
            self._pins += self._live
            return view, self._live

    def _unpin(self, reader: int, pinned: bool, pos: int) -> None:
        with self._lock:
            if reader in self._readers:
                self._readers[reader] = pos
            if pinned:
                self._pins -= 1
                self._unpinned.notify_all()

    def close(self, reader: int) -> None:
        with self._lock:
            self._readers.pop(reader, None)
            self._forget_passed()
            if not self._live and not self._readers:
                self._array = None  # its copy served its last stream

    def holding(self) -> bool:
        """A detached source still keeping a copy for streams in progress."""
        with self._lock:
            return not self._live and self._array is not None

    def retire(self, why: str) -> None:
        """Free the copy kept for streams in progress: their next read raises Reject
        (`why`), and the island reconnects for the newest version."""
        with self._lock:
            self._array, self._retired = None, why
            self._built.clear()

    def _held(self) -> np.ndarray:
        """The bytes it streams: a live or detached source's (never a retired one's, nor
        one whose last reader closed: nobody reads those)."""
        if self._array is None:
            raise RuntimeError("broadcast source read after it let its bytes go")
        return self._array

    def _forget_passed(self) -> None:
        """Drop the built chunks every open reader has passed (all, with no reader)."""
        slowest = min(self._readers.values(), default=None)
        for key in [k for k in self._built if slowest is None or k[1] <= slowest]:
            del self._built[key]

    def detach(self) -> int:
        """Stop viewing the live weights; returns the bytes copied for readers."""
        with self._lock:
            if not self._live:
                return 0
            self._live = False
            if not self._readers:
                self._array = None
                return 0
            lo = min(self._readers.values())
            self._array = self._held()[lo - self._offset:].copy()
            self._offset = lo
            while self._pins:  # direct sends from the live weights: each one syscall
                self._unpinned.wait()
            return self._array.size


@dataclass(frozen=True)
class Broadcast:
    version: int
    fragment: int
    source: Source  # the f32 weights every island holds (this fragment)
    encoding: str
    final: bool
    delta: np.ndarray | None = None  # compressed (new − previous) for islands at base_version
    base_version: int = 0

    @property
    def update(self) -> np.ndarray:
        """The compressed update, for a broadcast that has one."""
        if self.delta is None:
            raise RuntimeError(f"broadcast of version {self.version} carries no update")
        return self.delta

    @property
    def nbytes(self) -> int:
        """Bytes one island is sent: the update when there is one, else the weights."""
        return self.delta.size if self.delta is not None else self.source.size


class Downlink:
    """What islands are sent: the newest broadcast per fragment and, under a
    compressed downlink, the weights the islands hold (the sum of the updates sent so
    far: islands add the same bytes, so they hold these exact bits; the gap to Θ
    rides along in the next update). With f32 the islands hold Θ itself."""

    KEPT = 2  # older versions per fragment kept (copied) for streams still sending them

    def __init__(self, encoding: str):
        self.encoding = encoding
        self.latest: dict[int, Broadcast] = {}
        self.island_theta: np.ndarray | None = None
        self.kept: dict[int, list[Broadcast]] = {}  # per fragment, oldest first

    def next(self, theta: np.ndarray, f: int, lo: int, hi: int, final: bool,
             version: int, filling: bool = False) -> Broadcast:
        """Fragment f (Θ[lo:hi]) at `version` for the islands (updates `island_theta`);
        the caller publishes it. The final weights always go out exact, in f32. Nothing
        is copied: the broadcast streams from the live weights (see `Source`), and a
        compressed update is encoded chunk by chunk into the one buffer all islands
        are sent. `filling`: Θ[lo:hi] is still being written (f32 only; `Filling`)."""
        if filling and self.encoding != "f32":
            raise ValueError("only an f32 downlink streams Θ while it is written")
        prev = self.latest.get(f)
        self.detach(f)
        delta = None
        if self.encoding == "f32":
            source = theta[lo:hi]
        else:
            if self.island_theta is None:  # each fragment's span is set at its first
                # broadcast (below); a shard's other fragments' pages are never touched
                self.island_theta = np.zeros(theta.shape, theta.dtype)
            source = self.island_theta[lo:hi]
            if final or prev is None:
                source[...] = theta[lo:hi]
            else:
                delta = chunked.encode_diff(theta[lo:hi], source, self.encoding)
        return Broadcast(version, f, Source(source, Filling(4 * (hi - lo)) if filling else None),
                         "f32", final, delta,
                         prev.version if prev else 0)

    def publish(self, broadcast: Broadcast) -> None:
        """`broadcast` becomes its fragment's newest: streams send it on."""
        self.latest[broadcast.fragment] = broadcast

    def newest(self) -> list[Broadcast]:
        """Each fragment's newest broadcast, by fragment."""
        return [bc for _, bc in sorted(self.latest.items())]

    def restore(self, island_theta: np.ndarray | None) -> None:
        """The weights islands hold under a compressed downlink, as saved."""
        self.island_theta = island_theta if self.encoding != "f32" else None

    def detach(self, f: int) -> None:
        """Before the weights of fragment f change: its broadcast stops viewing them."""
        prev = self.latest.get(f)
        if prev is not None:
            copied = prev.source.detach()
            if copied:
                log.info("fragment %d: %d bytes of version %d kept for streams in progress",
                         f, copied, prev.version)
                self._keep(f, prev)

    def _keep(self, f: int, bc: Broadcast) -> None:
        """`bc` now keeps a copy for its streams in progress: at most `KEPT` such
        versions of fragment f hold one; the streams of older ones are ended."""
        kept = [b for b in self.kept.get(f, []) if b.source.holding()] + [bc]
        while len(kept) > self.KEPT:
            old = kept.pop(0)
            old.source.retire(
                f"this stream fell behind: fragment {f} version {old.version} was still "
                f"being sent when version {bc.version} was replaced, and the syncer keeps "
                f"at most {self.KEPT} older versions for slow streams; reconnect for the "
                "newest (an island does so by itself)")
            log.warning("fragment %d: streams still sending version %d ended (%d newer "
                        "versions kept for slower streams); their islands reconnect",
                        f, old.version, self.KEPT)
        self.kept[f] = kept


class _Sizes(Protocol):
    def numel(self, f: int | None = None) -> int: ...


class Served(Protocol):
    """What a subscription reads of the run (`syncer.run.Run`, which imports this module)."""

    cond: threading.Condition

    @property
    def cfg(self) -> Config: ...

    @property
    def model(self) -> _Sizes: ...

    def newest_broadcasts(self) -> list[Broadcast]: ...

    def holds_back(self) -> bool: ...

    def asks_seed_of(self, learner_id: str) -> bool: ...

    def check_island(self, learner_id: str, generation: int) -> Member: ...

    def count_sent(self, nbytes: int) -> None: ...

    def owned(self) -> list[int]: ...


class Subscription:
    """One island's broadcast stream: what it has been sent (the newest version per
    fragment, and which fragments' final weights), so it gets each new version once,
    as a compressed update when it holds the version that update is against."""

    def __init__(self, run: Served, learner_id: str, generation: int):
        self.run, self.learner_id, self.generation = run, learner_id, generation
        self.sent: dict[int, int] = {}
        self.sent_final: set[int] = set()

    def _pending(self) -> Broadcast | None:
        for bc in self.run.newest_broadcasts():
            f = bc.fragment
            if bc.version > self.sent.get(f, -1) or (bc.final and f not in self.sent_final):
                return bc
        return None

    def wait_next(self, active: Callable[[], bool]) -> Outgoing | None:
        """The next broadcast to send, waiting while `active()`; None when it ends.
        Raises Reject when this connection has been superseded. A broadcast of the
        whole weights is opened for reading here, under the run's lock, so a commit
        that follows keeps its bytes for this stream (`Source.detach`)."""
        run = self.run
        with run.cond:
            bc = self._pending()
            while active() and (bc is None or run.holds_back()):
                if bc is None and run.asks_seed_of(self.learner_id):
                    raise Reject("unavailable", f"the run now asks {self.learner_id} for "
                                 "its initial weights as Θ (the seed): join again")
                run.cond.wait(timeout=1.0)  # (a commit not yet on disk: its Θ is not out)
                bc = self._pending()
            if bc is None:
                return None
            run.check_island(self.learner_id, self.generation)
            use_delta = bc.delta is not None and self.sent.get(bc.fragment) == bc.base_version
            return Outgoing(bc, use_delta, None if use_delta else bc.source.open())

    def send(self, out: Outgoing) -> Iterator[bytes]:
        """The chunks of one broadcast, as wire bytes built straight from the weights
        (or from the one compressed update all islands share); records it as sent once
        its last chunk is handed to the transport. (An island that has its final
        weights hangs up at once: the stream may be closed at that last `yield`, and
        the record must not depend on the transport asking for more.)"""
        bc, header = out.bc, self._header(out)
        chunks: Iterator[bytes]
        if out.use_delta:
            chunks = (wire.chunk_bytes(header if i == 0 else None, piece) for i, piece
                      in enumerate(net.chunks(bc.update.data.cast("B"))))
        else:
            chunks = source_chunks(header, bc.source, out.place)
        handed = False
        try:
            for last, piece in _marking_last(chunks):
                handed = last
                yield piece
        finally:
            out.release()
            if handed:
                self._sent(bc, header.payload_bytes)

    def send_to(self, out: Outgoing, sink: Sink) -> None:
        """One broadcast on the direct downlink (`yeto.wire`): its header frame, then
        its payload straight from the weights (`Source.stream_to`) or from the one
        compressed update all islands share; recorded as sent once the kernel has
        its last byte."""
        bc, header = out.bc, self._header(out)
        try:
            sink.send_header(header)
            if out.use_delta:
                sink.send_all(bc.update.data.cast("B"))
            else:
                bc.source.stream_to(out.place, sink)
        finally:
            out.release()
        self._sent(bc, header.payload_bytes)

    def _header(self, out: Outgoing) -> pb.BroadcastHeader:
        run, bc = self.run, out.bc
        return pb.BroadcastHeader(
            version=bc.version, round=bc.version, fragment=bc.fragment,
            encoding=run.cfg.downlink if out.use_delta else bc.encoding,
            numel=run.model.numel(bc.fragment),
            payload_bytes=bc.update.size if out.use_delta else bc.source.size,
            final=bc.final, delta=out.use_delta, base_version=bc.base_version)

    def _sent(self, bc: Broadcast, size: int) -> None:
        self.run.count_sent(size)
        self.sent[bc.fragment] = bc.version
        if bc.final:
            self.sent_final.add(bc.fragment)

    def all_finals_sent(self) -> bool:
        owned = self.run.owned()
        return bool(owned) and len(self.sent_final) == len(owned)


@dataclass
class Outgoing:
    """A broadcast picked for one stream: sent as the compressed update or whole
    (then `reader` holds its place in the broadcast's source until `release`)."""

    bc: Broadcast
    use_delta: bool
    reader: int | None

    @property
    def place(self) -> int:
        """Its reader of the source (a broadcast sent whole has one until `release`)."""
        if self.reader is None:
            raise RuntimeError("a broadcast sent whole is read through its open reader")
        return self.reader

    def release(self) -> None:
        if self.reader is not None:
            self.bc.source.close(self.reader)
            self.reader = None


def _marking_last(items: Iterable[T]) -> Iterator[tuple[bool, T]]:
    """(is_last, item) for each item, knowing the last one before it is yielded."""
    it = iter(items)
    try:
        item = next(it)
    except StopIteration:
        return
    for following in it:
        yield False, item
        item = following
    yield True, item


def source_chunks(header: pb.BroadcastHeader, source: Source, reader: int) -> Iterator[bytes]:
    """Chunks read from a broadcast's source (see `Source`), one at a time."""
    size = source.size
    for i, lo in enumerate(range(0, max(size, 1), net.CHUNK_BYTES)):
        hi = min(lo + net.CHUNK_BYTES, size)
        prefix = wire.chunk_prefix(header if i == 0 else None, hi - lo)
        yield source.read(reader, lo, hi, prefix)
