"""A push's stream driven step by step in this process, for the tests of what the run
does while a push arrives (staging, a push beside it, a stream broken off)."""

import contextlib

import numpy as np

from yeto.codec.receiver import PayloadReceiver

PIECE = 70_001  # bytes per message: pieces end anywhere, mid-value and mid-block


class Stream:
    """A push's stream as the service brings it (`syncer.staging.PushBody`), in this
    process and validated as the service validates it (`PayloadReceiver`): `upto`
    bytes arrive (in pieces of PIECE, ending mid-value), then `meanwhile(into)` runs
    (another push arriving, the run ending), then the rest, or nothing more when
    `broken`."""

    def __init__(self, payload, upto=None, meanwhile=None, broken=False, alone=True):
        self.payload, self.upto, self.meanwhile = payload, upto, meanwhile
        self.broken, self.alone, self.into = broken, alone, None

    def slot(self):
        return contextlib.nullcontext()

    def buffer(self, h, keep):
        return contextlib.nullcontext(None if keep else np.empty(len(self.payload), np.uint8))

    def arriving(self, h):
        return contextlib.nullcontext(self.alone)

    def receive(self, h, into, max_abs):
        self.into = into
        rx = PayloadReceiver(h.encoding, h.numel, into, max_abs)
        cut = len(self.payload) if self.upto is None else self.upto
        data = memoryview(self.payload)
        for lo in range(0, cut, PIECE):
            rx.add(data[lo:min(lo + PIECE, cut)])
        if self.meanwhile is not None:
            self.meanwhile(into)
        if not self.broken:
            rx.add(data[cut:])
        return rx.finish()
