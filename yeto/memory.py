"""Give freed memory back to the operating system.

A pass of the island over the weights frees its chunk buffers, and a transfer frees
its gRPC messages, some of them in other threads' malloc arenas; glibc keeps such
memory resident until it is trimmed, so it would sit beside the training steps that
follow. `trim()` returns it (glibc's malloc_trim); elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import sys

_malloc_trim = None


def trim() -> None:
    global _malloc_trim
    if _malloc_trim is None:
        _malloc_trim = False
        if sys.platform.startswith("linux"):
            try:
                _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
            except (OSError, AttributeError):
                pass
    if _malloc_trim:
        _malloc_trim(0)
