"""The island state machine, backend-neutral.

An island owns a flat float32 view of its trainable weights through two
callbacks, `get_weights() -> np.ndarray` and `set_weights(np.ndarray)`, supplied
by the torch or MLX edge. Everything else is here:

- anchor: the exact Θ bytes last received. `base` is the local weights whose
  progress the syncer already holds (the anchor, or the weights at the last push
  while its round is open); a push sends base − local, quantized with error
  feedback, so the pushes since an anchor add up to anchor − local.
- counters: loss tokens and optimizer steps since the last push.
- apply: broadcasts are applied only at step boundaries, inside `after_step`.
  Training overlaps the round trip, so when Θ arrives the island keeps the steps it
  made since its push: local ← Θ + (local − base), anchor ← base ← Θ. Every step
  is pushed exactly once; with `blocking=True` the island waits for Θ right after
  each push, so all islands hold bit-identical weights after every round.
- a push the syncer refuses is carried forward: its work, tokens, steps and
  quantization residual go into the next push. So is a push the syncer accepted
  but lost (it restarted from its last saved round): on rejoin the syncer reports
  the newest push it holds, and the island rolls back to before any newer one.
- finish: a last push, then the final Θ (f32) replaces the local weights exactly,
  so every island ends bit-identical to the syncer.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import grpc
import numpy as np

from yeto.client import Received, SyncerClient, SyncerError
from yeto.codec import ErrorFeedback
from yeto.layout import Layout

log = logging.getLogger("yeto.island")


@dataclass
class _Push:
    seq: int
    generation: int
    base_before: np.ndarray      # what `base` was before this push
    prev_residual: np.ndarray
    tokens: int
    steps: int
    future: Future
    accepted: bool | None = None  # None until the reply (or its loss) is known


class Island:
    def __init__(self, layout: Layout, get_weights: Callable[[], np.ndarray],
                 set_weights: Callable[[np.ndarray], None], *, client: SyncerClient | None,
                 sync_every: int = 50, sync_every_seconds: float = 0.0, wire: str = "q4",
                 blocking: bool = False,
                 on_sync: Callable[[], float] | None = None,
                 on_apply: Callable[[Received], None] | None = None,
                 start_timeout_s: float | None = None,
                 connect_grace_s: float = 5.0, finish_timeout_s: float = 1800.0,
                 offline_give_up_s: float = 60.0):
        if sync_every < 1:
            raise ValueError("sync_every must be >= 1")
        self.layout, self.client = layout, client
        self._get, self._set = get_weights, set_weights
        self.sync_every, self.wire, self.blocking = sync_every, wire, blocking
        # sync by wall time instead of steps: islands of mixed speed push at the same
        # rate, and token weighting lets the faster one count for more
        self.sync_every_seconds = float(sync_every_seconds)
        self._last_sync = time.monotonic()
        self.on_sync, self.on_apply = on_sync, on_apply
        self.start_timeout_s, self.connect_grace_s = start_timeout_s, connect_grace_s
        self.finish_timeout_s, self.offline_give_up_s = finish_timeout_s, offline_give_up_s
        self.feedback = ErrorFeedback(layout.numel, wire)
        self.anchor: np.ndarray | None = None
        self.base: np.ndarray | None = None
        self.pushed: list[_Push] = []  # pushes since the anchor was last replaced
        self.version = -1            # version of the anchor; -1 = not yet joined a run
        self.round = 0
        self.step = 0
        self.tokens = 0              # loss tokens since the last push
        self.steps = 0               # optimizer steps since the last push
        self.total_tokens = 0
        self.seq = 0
        self.finished = False
        self.train_loss = float("nan")
        self.eval_loss = float("nan")
        self.pushes = 0

    # ---- start ------------------------------------------------------------
    def start(self) -> None:
        """Join the run and adopt its Θ; trains locally if the syncer is unreachable."""
        self.anchor = self.base = self._get()
        if self.client is None:
            return
        self.client.start(self.anchor)
        t0 = last_log = time.monotonic()
        while True:
            got = self.client.wait(timeout=1.0)
            if got is not None:
                self._apply(got)
                return
            if self.client.fatal:
                raise SyncerError(self.client.fatal)
            waited = time.monotonic() - t0
            if not self.client.connected.is_set() and waited >= self.connect_grace_s:
                log.warning("syncer %s not reachable after %.0fs: training locally; the island "
                            "joins when it comes up", self.client.address, waited)
                return
            if self.start_timeout_s is not None and waited >= self.start_timeout_s:
                log.warning("no weights from the syncer after %.0fs: training locally", waited)
                return
            if time.monotonic() - last_log >= 10:
                log.info("waiting for the syncer to start round 1 (quorum) ...")
                last_log = time.monotonic()

    # ---- per step ---------------------------------------------------------
    def after_step(self, loss_tokens: int, train_loss: float | None = None) -> bool:
        """Call once per optimizer step. Applies arrived weights, pushes when due.
        Returns True when the run is over (the final weights are loaded)."""
        self.step += 1
        self.steps += 1
        self.tokens += int(loss_tokens)
        self.total_tokens += int(loss_tokens)
        if train_loss is not None:
            self.train_loss = float(train_loss)
        if self.client is None:
            return False
        self._apply(self.client.take())
        if not self.finished and self.sync_due():
            self.sync()
        return self.finished

    def sync_due(self) -> bool:
        if self.sync_every_seconds > 0:
            return time.monotonic() - self._last_sync >= self.sync_every_seconds
        return self.step % self.sync_every == 0

    def sync(self) -> None:
        """Push base − local now (the training loop continues meanwhile)."""
        if self.client is None or self.finished:
            return
        self._last_sync = time.monotonic()
        self._settle()
        if self._awaiting_round():
            # one push in flight at most: wait for the round it joined to commit
            self._apply(self.client.wait(timeout=self.finish_timeout_s, need_connection=True))
            self._settle()
            if self.finished or self._awaiting_round():
                return  # run over, or offline: the work waits for a later push
        if self.on_sync is not None:
            self.eval_loss = float(self.on_sync())
        if not self.client.connected.is_set() or self.version < 0:
            return  # offline: the work stays in base − local for a later push
        local = self._get()
        prev = self.feedback.residual.copy()
        payload = self.feedback.encode(self.base - local)
        self.seq = max(self.seq, self.client.acked_seq + 1)
        fut = self.client.push(payload, encoding=self.wire, base_version=self.version,
                               loss_tokens=self.tokens, steps=self.steps, seq=self.seq,
                               train_loss=_nan(self.train_loss), eval_loss=_nan(self.eval_loss))
        self.pushed.append(_Push(self.seq, self.client.generation, self.base, prev,
                                 self.tokens, self.steps, fut))
        self.base = local
        self.seq += 1
        self.pushes += 1
        self.tokens = self.steps = 0
        if self.blocking:
            self._apply(self.client.wait(timeout=self.finish_timeout_s, need_connection=True))

    def _awaiting_round(self) -> bool:
        return any(p.accepted is not False for p in self.pushed)

    # ---- apply ------------------------------------------------------------
    def _apply(self, got: Received | None) -> None:
        if got is None:
            return
        self._settle(wait=True)
        if got.version == self.version and not got.final:
            return  # a rejoin re-sends the current Θ: nothing new
        if got.final:
            new = got.theta.copy()
        else:
            new = got.theta + (self._get() - self.base)
        self._set(new)
        self.anchor = self.base = got.theta
        self.pushed.clear()
        self.version, self.round = got.version, got.round
        self.finished = got.final
        log.debug("applied version %d%s", got.version, " (final)" if got.final else "")
        if self.on_apply is not None:
            self.on_apply(got)

    def _settle(self, wait: bool = False) -> None:
        """Learn the fate of pushes in flight; undo those the syncer does not hold."""
        for p in self.pushed:
            if p.accepted is None and (wait or p.future.done()):
                p.accepted = self._outcome(p)
        gen, acked = self.client.generation, self.client.acked_seq
        for p in self.pushed:  # the syncer restarted from a round saved before this push
            if p.accepted and p.generation != gen and p.seq > acked:
                p.accepted = False
        lost = next((i for i, p in enumerate(self.pushed) if p.accepted is False), None)
        if lost is None:
            return
        undone = self.pushed[lost:]
        log.warning("push %d not held by the syncer; its work goes into the next push",
                    undone[0].seq)
        self.base, self.feedback.residual = undone[0].base_before, undone[0].prev_residual
        self.tokens += sum(p.tokens for p in undone)
        self.steps += sum(p.steps for p in undone)
        del self.pushed[lost:]

    def _outcome(self, p: _Push) -> bool | None:
        try:
            reply = p.future.result(timeout=300)
            return bool(reply["accepted"] or reply["status"] == "duplicate")
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
                log.warning("push %d refused: %s", p.seq, e.details())
                return False
            if self.client.generation != p.generation:
                return self.client.acked_seq >= p.seq
            log.warning("push %d: no reply (%s); the rejoin will tell", p.seq, e.details())
            return None
        except (SyncerError, TimeoutError) as e:
            log.warning("push %d not delivered (%s)", p.seq, e)
            return False

    # ---- finish -----------------------------------------------------------
    def finish(self) -> bool:
        """Last push, then wait for the final Θ. Returns True when the final
        weights were received (the island is then bit-identical to the syncer)."""
        if self.client is None:
            return False
        try:
            finish_sent = 0  # generation the Finish went to; a rejoin needs it again
            t0 = last_seen = time.monotonic()
            while (not self.finished and self.version >= 0
                   and time.monotonic() - t0 < self.finish_timeout_s):
                if self.client.connected.is_set():
                    last_seen = time.monotonic()
                    self._settle()
                    if not self._awaiting_round():
                        if self.steps > 0:
                            self.sync()  # the last work (again, if a restart lost it)
                        elif finish_sent != self.client.generation:
                            finish_sent = self.client.generation
                            self.client.finish()
                self._apply(self.client.wait(timeout=1.0))
                if self.client.fatal or time.monotonic() - last_seen > self.offline_give_up_s:
                    break
            if not self.finished:
                log.warning("no final weights from the syncer; keeping local weights")
            return self.finished
        finally:
            self.client.close()


def _nan(x: float) -> float:
    return x if x is not None and math.isfinite(x) else float("nan")
