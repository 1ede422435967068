"""The streaming receiver both ends use: a payload assembled from the pieces it
arrives in (a push at the syncer, a broadcast at an island), validated as the bytes
come, so a bad payload is refused before it is held whole."""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar, cast, overload

import numpy as np

from yeto.codec import format as fmt
from yeto.codec.chunked import ITEM
from yeto.codec.format import Q4_BLOCK, Payload


class Holder(Protocol):
    """Where a receiver may write a payload other than an array: it has a length and
    takes the pieces in order (`KeepNothing`, `yeto.codec.buffers.SpilledPayload`)."""

    def __len__(self) -> int: ...

    def write(self, piece: Payload) -> None: ...


B = TypeVar("B", bound="np.ndarray | Holder")


class KeepNothing:
    """Where a receiver puts bytes its caller does not keep: the caller passes on the
    checked values `PayloadReceiver.add` returns as they arrive."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def write(self, piece: Payload) -> None:
        pass


class PayloadReceiver(Generic[B]):
    """Assembles one payload of `encoding`/`numel` from byte pieces into `into`: a
    uint8 array of the wire size (a new one by default), or a holder with a length
    and `write(piece)` (a `yeto.codec.buffers.SpilledPayload`, `KeepNothing`).

    Validates on arrival: q4 block scales (they lead the payload), f32/bf16 values,
    each up to the last whole float received: finite, and with `max_abs` within it.
    `add` raises `CodecError` on the first bad byte and `ValueError` on a payload
    longer than announced; `finish` raises `ValueError` on a short one and returns
    `into`. An unknown encoding is a `CodecError` at construction."""

    @overload
    def __init__(self: PayloadReceiver[np.ndarray], encoding: str, numel: int,
                 into: None = None, max_abs: float | None = None) -> None: ...

    @overload
    def __init__(self, encoding: str, numel: int, into: B, max_abs: float | None = None
                 ) -> None: ...

    def __init__(self, encoding: str, numel: int, into: B | None = None,
                 max_abs: float | None = None) -> None:
        self.encoding, self.numel, self.max_abs = encoding, numel, max_abs
        self.size = fmt.encoded_size(encoding, numel)
        # into None: a PayloadReceiver[np.ndarray] (the first overload)
        self.buf: B = cast(B, np.empty(self.size, np.uint8)) if into is None else into
        if len(self.buf) != self.size:
            raise ValueError(f"buffer of {len(self.buf)} bytes for a {self.size}-byte payload")
        self.n = 0           # bytes received
        self._tail = b""     # received bytes of a value not yet whole (validated later)
        # bytes that are floats to check: q4's block scales, all of f32/bf16
        self._check_end = 4 * -(-numel // Q4_BLOCK) if encoding == "q4" else self.size

    @property
    def complete(self) -> bool:
        """Every byte announced has arrived."""
        return self.n == self.size

    def add(self, piece: bytes | memoryview) -> memoryview | bytes:
        """Take the next piece; returns the bytes of the values it made whole and that
        passed the checks (in order; a value split between pieces comes with the
        piece that ends it; empty for q4 codes, which are checked through their
        scales)."""
        k = len(piece)
        if self.n + k > self.size:
            raise ValueError(f"payload exceeds the {self.size} bytes its header announced")
        checked: memoryview | bytes = b""
        if self.n < self._check_end:
            checked = self._validate(memoryview(piece)[:self._check_end - self.n])
        if isinstance(self.buf, np.ndarray):
            self.buf[self.n:self.n + k] = np.frombuffer(piece, np.uint8)
        else:
            self.buf.write(piece)
        self.n += k
        return checked

    def _validate(self, part: memoryview) -> memoryview | bytes:
        item = 4 if self.encoding == "q4" else ITEM[self.encoding]
        data: memoryview | bytes = self._tail + bytes(part) if self._tail else part
        whole = len(data) - len(data) % item
        if whole and self.encoding == "q4":
            fmt.validate_q4_scales(data[:whole], self.max_abs)
        elif whole:
            fmt.validate(data[:whole], self.encoding, whole // item, self.max_abs)
        self._tail = bytes(data[whole:])
        return data[:whole] if self.encoding != "q4" else b""

    def finish(self) -> B:
        if self.n != self.size:
            raise ValueError(f"payload ended after {self.n} of {self.size} bytes")
        return self.buf
