"""Give freed memory back to the operating system.

A pass of the island over the weights frees its chunk buffers, and a transfer frees
its gRPC messages, some of them in other threads' malloc arenas; glibc keeps such
memory resident until it is trimmed, so it would sit beside the training steps that
follow. `trim()` returns it (glibc's malloc_trim); elsewhere it does nothing.

`limit_arenas()` keeps it from piling up between trims in a process with many threads
(the syncer: gRPC's handler threads receive pushes and send broadcasts at once):
glibc gives up to 8 malloc arenas per core, each keeping the chunk buffers freed in
it resident; with two, every thread reuses the same few freed buffers. A freed 4 MiB
buffer is then reused without a page fault (on a VM a fresh page costs more than the
copy into it). What it does to the syncer's memory and round time, against glibc's
default and a fixed mmap threshold: BENCHMARKS.md, "Memory: bytes per parameter"
(malloc arenas).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from typing import Literal

_malloc_trim: Callable[[int], object] | Literal[False] | None = None  # False: none here
_M_ARENA_MAX = -8  # glibc's mallopt parameter number


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


def limit_arenas(count: int = 2) -> bool:
    """Let malloc use at most `count` arenas (glibc only; elsewhere nothing happens).
    Call it before the process starts threads. Returns whether the setting took."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_ARENA_MAX, int(count)))
    except (OSError, AttributeError):
        return False
