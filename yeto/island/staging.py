"""Where a push is staged (`DeltaEncoder.stage`: x = residual + (anchor − local) into
the residual's place, the anchor moved to local).

Staging reads the weights as they are at the push, so it must be done before they
next *change* — the next optimizer step, or the next apply of a broadcast — but not
before the next forward and backward, which only read them. A training loop that
calls `Island.before_update()` right before every change it makes to the weights (the
guard; `Island.guard_updates` installs it and says so) lets a push whose encode runs
on the background thread be staged there too, while the loop computes its next
gradient; the guard waits for what is left of the staging. The island's own applies
and pushes wait for it as well. Without the guard a push is staged in the training
thread, which is right for any loop. A backend whose `snapshot(lo, hi)` copies the
weights without the host waiting (a CUDA model) is staged from that copy in the
background, guard or not.

Staging in the background holds no byte more: it reads the weights through the
backend's range access (a backend without it hands over the flat copy its pass makes
anyway, taken in the training thread) and writes the anchor and the residual, as in
the training thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future

from yeto.codec import Encoder
from yeto.island.encoder import DeltaEncoder
from yeto.island.ledger import PUSH_TIMEOUT_S, Push, PushLedger
from yeto.island.weights import WeightPasses, reading
from yeto.layout import Fragment


class Stager:
    """Stages the pushes of an island over `passes` into `encoder`; `background`: its
    pushes are encoded on a background thread (staging may move there once the loop
    calls the guard: `guarded`). A push staged in the background whose staging fails
    is withdrawn from `ledger` when the guard learns of it."""

    def __init__(self, passes: WeightPasses, encoder: DeltaEncoder, ledger: PushLedger,
                 background: bool):
        self.passes, self.encoder, self.ledger = passes, encoder, ledger
        self.background = background
        self.guarded = False
        self.pending: list[tuple[Future, Push | None]] = []  # staging in the background
        self.stage_s: list[float] = []  # per push staged in the background: its seconds

    @property
    def deferred(self) -> bool:
        """Pushes are staged on the background thread (behind the guard)."""
        return self.background and self.guarded

    def prepare(self, frag: Fragment) -> Callable[[], Encoder]:
        """What encodes fragment `frag`'s push on the push's thread. Staged here, in the
        training thread, unless the backend has a snapshot or the loop has the guard:
        then staged on the push's thread first."""
        copy = self.passes.weights.snapshot(frag.start, frag.stop) if self.background else None
        if copy is not None:
            return lambda: self.encoder.encode_staged(
                self.encoder.stage(frag, reading(copy), tidy=False))
        if self.deferred:
            return self._in_background(frag)
        with self.passes.open() as w:
            staged = self.encoder.stage(frag, w)
        return lambda: self.encoder.encode_staged(staged)

    def _in_background(self, frag: Fragment) -> Callable[[], Encoder]:
        self.encoder.feedback.done()  # only the training thread replaces the residual
        source = self.passes.read_only()
        done: Future = Future()
        self.pending.append((done, None))

        def encode() -> Encoder:
            t0 = time.perf_counter()
            try:
                with source as w:
                    staged = self.encoder.stage(frag, w, tidy=False)
            except BaseException as e:  # noqa: BLE001 - the guard re-raises it
                done.set_exception(e)
                raise
            self.stage_s.append(time.perf_counter() - t0)
            done.set_result(None)
            return self.encoder.encode_staged(staged)
        return encode

    def sent(self, push: Push) -> None:
        """`push` is the one `prepare` was last called for."""
        if self.pending and self.pending[-1][1] is None:
            self.pending[-1] = (self.pending[-1][0], push)

    def wait(self) -> float:
        """The guard: wait until every push staging in the background is staged, and
        return the seconds waited. A staging that failed (non-finite weights: a
        CodecError) is withdrawn from the ledger, so its steps are owed again, and its
        error is raised here, in the training thread."""
        if not self.pending:
            return 0.0
        t0 = time.perf_counter()
        pending = [f for f, _ in self.pending]
        futures.wait(pending, timeout=PUSH_TIMEOUT_S)
        if not all(f.done() for f in pending):
            raise RuntimeError(f"a push was not staged within {PUSH_TIMEOUT_S:.0f} s: the "
                               "island stops rather than change the weights it reads")
        waited = time.perf_counter() - t0
        staged, self.pending = self.pending, []
        failed = [(f.exception(), p) for f, p in staged if f.exception() is not None]
        for _, p in failed:
            if p is not None:
                self.ledger.withdraw(p)
        if failed:
            raise failed[0][0]
        return waited
