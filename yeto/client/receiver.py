"""Broadcasts from the syncer to the island: reassembled (or passed on as a stream) and
checked as their chunks arrive (`yeto.codec.receiver.PayloadReceiver`), decoded
(`Downlink`), and held as the newest of their fragment until the island takes them.

A broadcast is reassembled whole (one fragment of f32) unless the island asked for
streams (`stream_broadcasts()`): then a large f32 broadcast is handed over at once as
a `yeto.transport.ThetaStream` and its values are passed on as they arrive, so the
island applies them into the model without the fragment ever being held whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import numpy as np

from yeto import codec
from yeto.client.connection import Connection
from yeto.codec.receiver import KeepNothing, PayloadReceiver
from yeto.memory import trim
from yeto.transport import Received, ThetaStream

# broadcasts above this size are streamed to a caller that asked for streams
STREAM_MIN_BYTES = 8 << 20


class BadBroadcast(grpc.RpcError):
    """A malformed broadcast: drop the connection and rejoin (the syncer re-sends Θ)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def code(self):
        return grpc.StatusCode.DATA_LOSS

    def details(self):
        return self.message


class Downlink:
    """The downlink's decoding state, all of it: with a compressed downlink the syncer
    sends updates against the Θ the island holds, so the Θ of each fragment is kept
    here (one f32 copy) to add them to. The uplink's state (error feedback) is the
    island's (`yeto.codec.ErrorFeedback` in its push encoder)."""

    def __init__(self):
        self.theta_of: dict[int, tuple[int, np.ndarray]] = {}  # fragment -> (version, Θ)
        self.keep = True  # keep each Θ for compressed updates

    def decode(self, header, buf: np.ndarray) -> np.ndarray:
        """The fragment's Θ from a whole, checked payload (f32 used in place)."""
        if header.delta:  # an update to the version we hold: the same adds as the syncer
            current = self.theta_of.get(header.fragment)
            if current is None and not self.keep:
                self.keep = True
                raise BadBroadcast("the syncer sends compressed updates: rejoining for the "
                                   "full weights (kept from now on to add updates to)")
            if current is None or current[0] != header.base_version:
                raise BadBroadcast(f"broadcast update against version {header.base_version}, "
                                   f"but this island holds {current and current[0]}")
            theta = current[1].copy()
            codec.decode_add(buf, header.encoding, header.numel, theta, 1.0)
        elif header.encoding == "f32":  # checked as it arrived (_Buffered), used in place
            theta = buf.view(np.float32)
        else:
            theta = codec.decode(buf, header.encoding, header.numel)
        if self.keep:
            self.theta_of[header.fragment] = (header.version, theta)
        return theta


class BroadcastReceiver:
    """The island's inbox: the newest untaken broadcast of each fragment, filled by
    `listen` on the connection's thread, emptied by `take` / `wait` on the island's.
    `on_hand_over(got)`: called as each broadcast is handed over (`yeto.sim`)."""

    def __init__(self, link: Connection):
        self.link = link
        self.downlink = Downlink()
        self.latest: dict[int, Received] = {}
        self.streams = False
        self.stream_min_bytes = STREAM_MIN_BYTES
        self.finished = False  # the final broadcast arrived
        self.bytes_down = 0
        self.wait_s = 0.0
        self.on_hand_over: Callable[[Received], None] | None = None

    def stream_broadcasts(self) -> None:
        """Hand large f32 broadcasts over as `ThetaStream`s, and keep no copy of Θ
        unless the syncer sends compressed updates (the join reply says so; a syncer
        older than that field is found out by its first update, and the client then
        rejoins once for the full weights)."""
        self.streams = True
        self.downlink.keep = False

    def joined(self, downlink: str) -> None:
        """The join reply's downlink encoding (empty from a syncer older than the
        field: learnt from its first update instead)."""
        if self.streams and downlink:
            self.downlink.keep = downlink != "f32"

    def listen(self, stream) -> None:
        """Reassemble each broadcast from its chunks (or pass a stream on) and hand it
        over; a malformed one raises `BadBroadcast` (the island rejoins)."""
        sink = None
        try:
            for chunk in stream:
                if chunk.HasField("header"):
                    if sink is not None:
                        raise BadBroadcast("a broadcast header arrived inside a broadcast")
                    sink = self._sink(chunk.header)
                if sink is None:
                    raise BadBroadcast("broadcast stream started without a header")
                if sink.add(chunk.data):  # a view into the received message
                    sink = None
        except BaseException as e:
            if sink is not None:
                sink.fail(str(e) or type(e).__name__)
            if isinstance(e, ValueError):  # CodecError too: reconnect, as for any broken
                raise BadBroadcast(f"bad broadcast: {e}") from e  # broadcast, not end the thread
            raise

    def _sink(self, header):
        # a compressed downlink adds its updates to the Θ kept here: that Θ comes whole
        if (self.streams and not self.downlink.keep and not header.delta
                and header.encoding == "f32" and header.payload_bytes >= self.stream_min_bytes):
            return _Streamed(self, header)
        return _Buffered(self, header)

    def deliver(self, header, buf: np.ndarray) -> None:
        theta = self.downlink.decode(header, buf)
        self.bytes_down += len(buf)
        self.hand_over(Received(header.version, header.fragment, header.final, theta))

    def hand_over(self, got: Received, done: bool | None = None) -> None:
        """Make `got` the newest broadcast of its fragment; `done`: the final weights are
        all in (default: `got.final`; a stream's are in when it ends)."""
        with self.link.cond:
            self.latest[got.fragment] = got
            self.finished = self.finished or (got.final if done is None else done)
            self.link.cond.notify_all()
        if self.on_hand_over is not None:
            self.on_hand_over(got)

    def final_in(self) -> None:
        with self.link.cond:
            self.finished = True
            self.link.cond.notify_all()

    def alive(self) -> bool:
        return not self.link.closed

    def take(self) -> list[Received]:
        """The newest broadcast of each fragment not yet taken (maybe none)."""
        with self.link.cond:
            got, self.latest = list(self.latest.values()), {}
            return got

    def wait(self, timeout: float | None, need_connection: bool = False) -> list[Received]:
        """Block until a broadcast arrives (or timeout / fatal error / close)."""
        link = self.link
        t0 = time.perf_counter()
        deadline = None if timeout is None else time.monotonic() + timeout
        with link.cond:
            while not self.latest:
                if link.closed or link.fatal or (need_connection and not link.connected.is_set()):
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                link.cond.wait(timeout=0.5 if left is None else min(left, 0.5))
        self.wait_s += time.perf_counter() - t0
        return self.take()


def _receiver(header, keep: bool = True) -> PayloadReceiver:
    """The receiver of one broadcast, its size checked against its header; `keep`:
    into a buffer of its own, else the caller passes the values on as they arrive."""
    size = codec.encoded_size(header.encoding, header.numel)
    if header.payload_bytes != size:
        raise BadBroadcast(f"{header.encoding} broadcast of {header.numel} values must be "
                           f"{size} bytes, header says {header.payload_bytes}")
    return PayloadReceiver(header.encoding, header.numel, None if keep else KeepNothing(size))


class _Buffered:
    """A broadcast reassembled whole, then handed over; checked as it arrives (values
    or q4 scales, `PayloadReceiver`), each piece while it is still in the cache."""

    def __init__(self, owner: BroadcastReceiver, header):
        self.owner, self.header = owner, header
        self.rx = _receiver(header)

    def add(self, data: memoryview) -> bool:
        self.rx.add(data)
        if not self.rx.complete:
            return False
        self.owner.deliver(self.header, self.rx.finish())
        return True

    def fail(self, why: str) -> None:
        pass


class _Streamed:
    """A large f32 broadcast handed over at once as a `ThetaStream`; its values are
    checked (`PayloadReceiver`) and passed on as they arrive."""

    def __init__(self, owner: BroadcastReceiver, header):
        self.owner, self.header = owner, header
        self.rx = _receiver(header, keep=False)
        self.stream = ThetaStream(header.numel)
        self.dropped = False
        owner.hand_over(Received(header.version, header.fragment, header.final, self.stream),
                        done=False)

    def add(self, data: memoryview) -> bool:
        piece = np.frombuffer(self.rx.add(data), np.float32)  # a CodecError: reconnect
        if piece.size and not self.dropped:
            self.dropped = not self.stream.put(piece, self.owner.alive)
        if not self.rx.complete:
            return False
        self.stream.end()
        trim()  # the chunks' messages, freed here and in the island's thread
        self.owner.bytes_down += self.rx.n
        if self.header.final:
            self.owner.final_in()
        return True

    def fail(self, why: str) -> None:
        self.stream.fail(why)
