"""The outer step behind its broadcast.

Without a state dir nothing has to reach the disk before islands may see a commit, so
a round of fragment f (not the run's last) is published before its outer step: the
broadcast of the new Θ[f] is announced at once and each chunk streams as soon as the
step has written it (`Filling`), while the step goes on, on a thread of its own
(`start`). Islands apply the chunks as they arrive (`yeto.codec.receiver`), so the
step, the send and the apply overlap instead of following each other.

The bytes are the same (the step is the same pass, `MergeAccumulator.
step_outer`); no island holds the new version before the syncer does (the payload's
last byte waits for the commit to complete: `Filling.complete`); pushes wait for the
step to end (`Committer.check_saved`) and no other round commits meanwhile (the
commit is pending until then: `syncer.commit.Committer`). A step that makes Θ
non-finite stops at that chunk: readers are woken with an error and the run fails
(`python -m syncer` exits non-zero) before any island has the version. With a state
dir, a compressed downlink or the run's last round, the step runs whole before the save
(`syncer.commit`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from syncer.merge import NonFinite

T = TypeVar("T")

WAIT_S = 600.0  # the longest a reader waits for one chunk of the step


class StepFailed(RuntimeError):
    """The step behind a broadcast failed: its stream cannot be completed."""


class Filling:
    """Which bytes of a payload being produced are final: chunks are marked `done` in
    any order; a reader of bytes [lo, hi) waits until every byte before hi is done.
    The last byte also waits for `complete` (the commit is whole); `abort` wakes
    every reader with an error. Readers are woken each `WAKE_BYTES` of progress (and
    at the end), not at every chunk: a reader waits for a message's or a send's worth
    (1 or 4 MiB), and each wake-up of every reader costs the step's thread and theirs."""

    WAKE_BYTES = 1 << 20  # net.CHUNK_BYTES: a gRPC broadcast message

    def __init__(self, size: int):
        self.size = size
        self._ready = 0                 # bytes [0, _ready) are done
        self._done: dict[int, int] = {}  # chunks done beyond _ready: start -> end
        self._complete = False
        self._failed: str | None = None
        self._cond = threading.Condition()

    def done(self, lo: int, hi: int) -> None:
        with self._cond:
            self._done[lo] = hi
            before = self._ready
            while self._ready in self._done:
                self._ready = self._done.pop(self._ready)
            if self._ready // self.WAKE_BYTES > before // self.WAKE_BYTES or \
                    self._ready == self.size:
                self._cond.notify_all()

    def complete(self) -> None:
        with self._cond:
            self._complete = True
            self._cond.notify_all()

    def abort(self, why: str) -> None:
        with self._cond:
            self._failed = why
            self._cond.notify_all()

    def wait(self, hi: int, timeout: float = WAIT_S) -> None:
        """Until bytes [0, hi) may be read; raises StepFailed if the step failed or
        did not get there within `timeout` seconds."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._failed or self._readable(hi), timeout)
            if self._failed:
                raise StepFailed(f"the outer step behind this broadcast failed: {self._failed}")
            if not ok:
                raise StepFailed(f"the outer step behind this broadcast did not reach byte "
                                 f"{hi} of {self.size} in {timeout:.0f} s")

    def _readable(self, hi: int) -> bool:
        return hi <= self._ready and (hi < self.size or self._complete)


def start(fragment: int, filling: Filling, lock: threading.Condition,
          step: Callable[[Callable[[int, int], None]], T], stepped: Callable[[T], None],
          failed: Callable[[NonFinite], None], fail: Callable[[str], None]
          ) -> threading.Thread:
    """On a thread of its own: `step(on_chunk)` (the outer step of `fragment`, calling
    `on_chunk(lo, hi)` for each chunk of values it has written), then `stepped(result)`
    under `lock`; `failed(e)` on NonFinite. Any other error is `fail`ed: the run ends."""
    thread = threading.Thread(target=_step,
                              args=(fragment, filling, lock, step, stepped, failed, fail),
                              name=f"outer-step-{fragment}", daemon=True)
    thread.start()
    return thread


def _step(fragment: int, filling: Filling, lock: threading.Condition,
          step: Callable[[Callable[[int, int], None]], T], stepped: Callable[[T], None],
          failed: Callable[[NonFinite], None], fail: Callable[[str], None]) -> None:
    try:
        out = step(lambda lo, hi: filling.done(4 * lo, 4 * hi))  # f32: 4 bytes a value
    except NonFinite as e:
        filling.abort(str(e))
        with lock:
            failed(e)
        return
    except BaseException as e:  # a thread that dies ends the run, loudly
        filling.abort(repr(e))
        fail(f"the outer step of fragment {fragment} failed: {e!r}")
        raise
    try:
        with lock:
            stepped(out)
    except BaseException as e:
        filling.abort(repr(e))
        fail(f"the commit of fragment {fragment}'s round failed after its step: {e!r}")
        raise
