"""The island state machine, backend-neutral.

An island owns a flat float32 view of its trainable weights through two
callbacks, `get_weights() -> np.ndarray` and `set_weights(np.ndarray)`, supplied
by the torch or MLX edge. Everything else is here:

- anchor: the exact Θ bytes last received; a push sends Δ = anchor − local,
  quantized with error feedback.
- counters: loss tokens and optimizer steps since the last push.
- apply: broadcasts are applied only at step boundaries, inside `after_step`.
  Training overlaps the round trip, so when Θ arrives the island keeps the steps it
  made since its push: local ← Θ + (local − local_at_push), anchor ← Θ. Every step
  is pushed exactly once; with `blocking=True` the island waits for Θ right after
  each push, so all islands hold bit-identical weights after every round.
- a push the syncer refuses is carried forward: its work, tokens, steps and
  quantization residual go into the next push.
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
class _Pending:
    seq: int
    base_version: int
    local_at_push: np.ndarray
    prev_residual: np.ndarray
    tokens: int
    steps: int
    future: Future


class Island:
    def __init__(self, layout: Layout, get_weights: Callable[[], np.ndarray],
                 set_weights: Callable[[np.ndarray], None], *, client: SyncerClient | None,
                 sync_every: int = 50, wire: str = "q4", blocking: bool = False,
                 on_sync: Callable[[], float] | None = None, start_timeout_s: float | None = None,
                 connect_grace_s: float = 5.0, finish_timeout_s: float = 1800.0,
                 offline_give_up_s: float = 60.0):
        if sync_every < 1:
            raise ValueError("sync_every must be >= 1")
        self.layout, self.client = layout, client
        self._get, self._set = get_weights, set_weights
        self.sync_every, self.wire, self.blocking = sync_every, wire, blocking
        self.on_sync = on_sync
        self.start_timeout_s, self.connect_grace_s = start_timeout_s, connect_grace_s
        self.finish_timeout_s = finish_timeout_s
        self.offline_give_up_s = offline_give_up_s
        self.feedback = ErrorFeedback(layout.numel, wire)
        self.anchor: np.ndarray | None = None
        self.version = -1            # version of the anchor; -1 = not yet joined a run
        self.round = 0
        self.step = 0
        self.tokens = 0              # loss tokens since the last push
        self.steps = 0               # optimizer steps since the last push
        self.total_tokens = 0
        self.seq = 0
        self.pending: _Pending | None = None
        self.finished = False
        self.train_loss = float("nan")
        self.eval_loss = float("nan")
        self.pushes = 0

    # ---- start ------------------------------------------------------------
    def start(self) -> None:
        """Join the run and adopt its Θ; trains locally if the syncer is unreachable."""
        local = self._get()
        self.anchor = local.copy()
        if self.client is None:
            return
        self.client.start(local)
        t0 = time.monotonic()
        last_log = t0
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
        if not self.finished and self.step % self.sync_every == 0:
            self.sync()
        return self.finished

    def sync(self) -> None:
        """Push Δ = anchor − local now (the training loop continues meanwhile)."""
        if self.client is None or self.finished:
            return
        if self.pending is not None:
            # one push in flight at most: wait for the round it joined to commit
            got = self.client.wait(timeout=self.finish_timeout_s, need_connection=True)
            self._apply(got)
            if self.finished or self.pending is not None:
                return  # run over, or offline: the work waits for a later push
        if self.on_sync is not None:
            self.eval_loss = float(self.on_sync())
        if not self.client.connected.is_set() or self.version < 0:
            return  # offline: the work stays in local − anchor for a later push
        local = self._get()
        prev = self.feedback.residual.copy()
        payload = self.feedback.encode(self.anchor - local)
        self.seq = max(self.seq, self.client.acked_seq + 1)
        fut = self.client.push(payload, encoding=self.wire, base_version=self.version,
                               loss_tokens=self.tokens, steps=self.steps, seq=self.seq,
                               train_loss=_nan(self.train_loss), eval_loss=_nan(self.eval_loss))
        self.pending = _Pending(self.seq, self.version, local, prev, self.tokens, self.steps, fut)
        self.seq += 1
        self.pushes += 1
        self.tokens = self.steps = 0
        if self.blocking:
            self._apply(self.client.wait(timeout=self.finish_timeout_s, need_connection=True))

    # ---- apply ------------------------------------------------------------
    def _apply(self, got: Received | None) -> None:
        if got is None:
            return
        if got.version == self.version and not got.final:
            return
        base = self._resolve_pending()
        if got.final:
            new = got.theta.copy()
        else:
            local = self._get()
            new = got.theta + (local - base)
        self._set(new)
        self.anchor = got.theta
        self.version, self.round = got.version, got.round
        self.finished = got.final
        log.debug("applied version %d%s", got.version, " (final)" if got.final else "")

    def _resolve_pending(self) -> np.ndarray:
        """The local weights whose progress the syncer now holds."""
        p, self.pending = self.pending, None
        if p is None:
            return self.anchor
        accepted = False
        try:
            reply = p.future.result(timeout=300)
            accepted = reply["accepted"] or reply["status"] == "duplicate"
        except grpc.RpcError as e:
            definite = e.code() in (grpc.StatusCode.FAILED_PRECONDITION,
                                    grpc.StatusCode.INVALID_ARGUMENT)
            accepted = not definite and self.client.acked_seq >= p.seq
            log.warning("push %d %s (%s)", p.seq, "landed" if accepted else "not merged, "
                        "carried into the next push", e.details())
        except (SyncerError, TimeoutError) as e:
            log.warning("push %d not delivered (%s); carried into the next push", p.seq, e)
        if accepted:
            return p.local_at_push
        self.feedback.residual = p.prev_residual
        self.tokens += p.tokens
        self.steps += p.steps
        return self.anchor

    # ---- finish -----------------------------------------------------------
    def finish(self) -> bool:
        """Last push, then wait for the final Θ. Returns True when the final
        weights were received (the island is then bit-identical to the syncer)."""
        if self.client is None:
            return False
        try:
            if not self.finished and self.steps > 0:
                self.sync()
            if not self.finished:
                self.client.finish()
            t0 = last_seen = time.monotonic()
            while (not self.finished and self.version >= 0
                   and time.monotonic() - t0 < self.finish_timeout_s):
                self._apply(self.client.wait(timeout=1.0))
                if self.client.connected.is_set():
                    last_seen = time.monotonic()
                if self.client.fatal or time.monotonic() - last_seen > self.offline_give_up_s:
                    break
            if not self.finished:
                log.warning("no final weights from the syncer; keeping local weights")
            return self.finished
        finally:
            self.client.close()


def _nan(x: float) -> float:
    return x if x is not None and math.isfinite(x) else float("nan")
