"""Give freed memory back to the operating system.

A pass of the island over the weights frees its chunk buffers, and a transfer frees
its gRPC messages, some of them in other threads' malloc arenas; glibc keeps such
memory resident until it is trimmed, so it would sit beside the training steps that
follow. `trim()` returns it (glibc's malloc_trim); elsewhere it does nothing.

`map_large_buffers()` keeps it from piling up between trims: glibc raises its mmap
threshold each time a large block is freed (up to 32 MiB), after which 4 MiB chunk
buffers come from per-thread arenas and stay resident there; a fixed threshold keeps
every buffer of 1 MiB or more in its own mapping, returned to the system on free.
Measured on the syncer with 4 islands at 1e8 parameters: 12.1 -> 11.2 B/param
(BENCHMARKS.md, Memory).
"""

from __future__ import annotations

import ctypes
import sys

_malloc_trim = None
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


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


def map_large_buffers(threshold: int = 1 << 20) -> bool:
    """Serve allocations of `threshold` bytes or more with their own mmap (glibc only;
    elsewhere nothing happens). Returns whether the setting took."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False
