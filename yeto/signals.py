"""Stopping on SIGINT/SIGTERM: the first signal asks for a clean stop, the second
stops at once. Islands, the syncer and `yeto launch` all stop this way.

    with GracefulStop(on_first=lambda name: log.warning("%s: stopping", name)) as stop:
        while not stop.is_set():
            ...
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeAlias

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# what signal.signal takes and signal.getsignal gives
_Handler: TypeAlias = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


def _interrupt(name: str) -> None:
    raise KeyboardInterrupt(name)


class GracefulStop:
    """First signal: `on_first(name)` runs and the stop event is set. Second signal:
    `on_second(name)` runs (default: raise KeyboardInterrupt, i.e. stop at once).
    Handlers are installed on `__enter__` (main thread only; elsewhere the event is
    still usable, set by the caller) and the previous ones restored on `__exit__`."""

    def __init__(self, on_first: Callable[[str], None] | None = None,
                 on_second: Callable[[str], None] | None = _interrupt):
        self.event = threading.Event()
        self._on_first, self._on_second = on_first, on_second
        self._old: dict[signal.Signals, _Handler] = {}

    def is_set(self) -> bool:
        return self.event.is_set()

    def set(self) -> None:
        self.event.set()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.event.is_set():
            if self._on_second is not None:
                self._on_second(name)
            return
        self.event.set()
        if self._on_first is not None:
            self._on_first(name)

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.getsignal(s) for s in SIGNALS}
            for s in SIGNALS:
                signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}


def ignore_signals() -> None:
    """After outputs are saved: a late signal during interpreter shutdown must not turn
    a clean exit into 'killed by SIGINT'."""
    if threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, signal.SIG_IGN)


def island_process(main: Callable[[list[str] | None], int], argv: list[str] | None = None
                   ) -> int:
    """Run an island's `main(argv)` as this process's work: a background thread that
    dies ends the process (`die_with_threads`), and once `main` returns (its outputs
    saved) a late signal cannot turn a clean exit into "killed by SIGINT". Process-wide
    settings: entry points only, never the library (an in-process island leaves its
    host's signals alone)."""
    die_with_threads()
    code = main(argv)
    ignore_signals()
    return code


def die_with_threads(exit_code: int = 70) -> None:
    """Make a background thread that dies of an exception end the process, loudly
    (its traceback, then exit `exit_code`), instead of leaving the process running
    without it: a dead commit or send thread would stall the run silently. What is
    on disk stays as the last atomic write left it."""
    def hook(args: threading.ExceptHookArgs) -> None:
        if issubclass(args.exc_type, SystemExit):
            return
        name = args.thread.name if args.thread else "?"
        logging.getLogger("yeto").critical(
            "background thread %s died: %s; stopping the process", name, args.exc_value,
            # (logging formats an exception value of None too; typeshed wants one)
            exc_info=(args.exc_type, args.exc_value, args.exc_traceback))  # type: ignore[arg-type]
        sys.stderr.flush()
        os._exit(exit_code)

    threading.excepthook = hook
