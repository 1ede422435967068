"""The island state machine, backend-neutral.

An island owns a flat float32 view of its trainable weights through two
callbacks, `get_weights() -> np.ndarray` and `set_weights(np.ndarray)`, supplied
by the torch or MLX edge. Everything else is here. The flat vector is cut into
the syncer's P fragments (P = 1 unless the syncer runs `--fragments P`); each
fragment follows the same rules on its own slice:

- anchor: the exact Θ bytes last received. `base` is the local weights whose
  progress the syncer already holds (the anchor, or the weights at the last push
  while its round is open); a push sends base − local, quantized with error
  feedback, so the pushes since an anchor add up to anchor − local.
- counters: loss tokens and optimizer steps since the fragment's last push.
- apply: broadcasts are applied only at step boundaries, inside `after_step`.
  Training overlaps the round trip, so when Θ arrives the island keeps the steps it
  made since its push: local ← Θ + (local − base), anchor ← base ← Θ. Every step
  is pushed exactly once; with `blocking=True` the island waits for Θ right after
  each push, so all islands hold bit-identical weights after every round.
  `merge_alpha` α mixes instead: local ← α·local + (1 − α)·(Θ + local − base);
  α = 0 (the default) keeps nothing of the pre-merge local weights but the steps
  the merge could not have seen, so islands stay as close to Θ as overlap allows.
- a push the syncer refuses is carried forward: its work, tokens, steps and
  quantization residual go into the next push. So is a push the syncer accepted
  but lost (it restarted from its last saved round): on rejoin the syncer reports
  the newest push it holds, and the island rolls back to before any newer one.
- schedule: fragment f is pushed every H steps, offset by f·H/P (Streaming
  DiLoCo), or every T seconds with the same stagger; at most `pipeline`
  fragments are in flight at once.
- finish: a last push of every fragment, then the final Θ (f32) replaces the
  local weights exactly, so every island ends bit-identical to the syncer.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from yeto.codec import ErrorFeedback
from yeto.layout import Fragment, Layout
from yeto.transport import Lost, Received, Refused, Transport, TransportError

log = logging.getLogger("yeto.island")


@dataclass
class _Push:
    fragment: int
    seq: int
    generation: int
    base_before: np.ndarray      # the fragment's `base` slice before this push
    prev_residual: np.ndarray    # and its error-feedback residual
    tokens: int
    steps: int
    future: Future
    accepted: bool | None = None  # None until the reply (or its loss) is known


class Island:
    def __init__(self, layout: Layout, get_weights: Callable[[], np.ndarray],
                 set_weights: Callable[[np.ndarray], None], *, client: Transport | None,
                 sync_every: int = 50, sync_every_seconds: float = 0.0, wire: str = "q4",
                 blocking: bool = False, merge_alpha: float = 0.0, pipeline: int = 1,
                 on_sync: Callable[[], float] | None = None,
                 on_apply: Callable[[Received], None] | None = None,
                 start_timeout_s: float | None = None, connect_grace_s: float = 5.0,
                 finish_timeout_s: float = 1800.0, offline_give_up_s: float = 60.0):
        if sync_every < 1:
            raise ValueError("sync_every must be >= 1")
        if not 0.0 <= merge_alpha < 1.0:
            raise ValueError("merge_alpha must be in [0, 1)")
        self.layout, self.client = layout, client
        self._get, self._set = get_weights, set_weights
        self.sync_every, self.wire, self.blocking = sync_every, wire, blocking
        # sync by wall time instead of steps: islands of mixed speed push at the same
        # rate, and token weighting lets the faster one count for more
        self.sync_every_seconds = float(sync_every_seconds)
        self.merge_alpha, self.pipeline = float(merge_alpha), max(1, pipeline)
        self.on_sync, self.on_apply = on_sync, on_apply
        self.start_timeout_s, self.connect_grace_s = start_timeout_s, connect_grace_s
        self.finish_timeout_s, self.offline_give_up_s = finish_timeout_s, offline_give_up_s
        self.feedback = ErrorFeedback(layout.numel, wire)
        self.anchor: np.ndarray | None = None
        self.base: np.ndarray | None = None
        self.pushed: list[_Push] = []
        self.versions: dict[int, int] = {}   # fragment -> version of its anchor
        self.finals: set[int] = set()        # fragments whose final weights arrived
        self.step = 0
        self.tokens: dict[int, int] = {}     # per fragment, since its last push
        self.steps: dict[int, int] = {}
        self.total_tokens = 0
        self.seq = 0
        self.finished = False
        self.train_loss = float("nan")
        self.eval_loss = float("nan")
        self.pushes = 0
        self._t0 = time.monotonic()
        self._next_due: dict[int, float] = {}

    # ---- fragments --------------------------------------------------------
    @property
    def fragments(self) -> list[Fragment]:
        p = self.client.num_fragments if self.client else 1
        if len(self.layout.fragments) != p:
            self.layout = self.layout.with_fragments(p)
        return self.layout.fragments

    @property
    def version(self) -> int:
        """Newest version applied (-1 before joining a run)."""
        return max(self.versions.values(), default=-1)

    # ---- start ------------------------------------------------------------
    def start(self) -> None:
        """Join the run and adopt its Θ; trains locally if the syncer is unreachable."""
        self.anchor = self._get()
        self.base = self.anchor.copy()
        if self.client is None:
            return
        self.client.start(self.anchor)
        t0 = last_log = time.monotonic()
        while True:
            self._apply_all(self.client.wait(timeout=1.0))
            if len(self.versions) == len(self.fragments):
                break
            if self.client.fatal:
                raise Refused(self.client.fatal)
            waited = time.monotonic() - t0
            if not self.client.connected.is_set() and waited >= self.connect_grace_s:
                log.warning("syncer %s not reachable after %.0fs: training locally; the island "
                            "joins when it comes up", self.client.address, waited)
                break
            if self.start_timeout_s is not None and waited >= self.start_timeout_s:
                log.warning("no weights from the syncer after %.0fs: training locally", waited)
                break
            if time.monotonic() - last_log >= 10:
                log.info("waiting for the syncer to start round 1 (quorum) ...")
                last_log = time.monotonic()
        self._t0 = time.monotonic()

    # ---- per step ---------------------------------------------------------
    def after_step(self, loss_tokens: int, train_loss: float | None = None) -> bool:
        """Call once per optimizer step. Applies arrived weights, pushes when due.
        Returns True when the run is over (the final weights are loaded)."""
        self.step += 1
        self.total_tokens += int(loss_tokens)
        for f in range(len(self.fragments)):
            self.tokens[f] = self.tokens.get(f, 0) + int(loss_tokens)
            self.steps[f] = self.steps.get(f, 0) + 1
        if train_loss is not None:
            self.train_loss = float(train_loss)
        if self.client is None:  # a single island: still evaluate every H steps
            if self.on_sync is not None and self.step % self.sync_every == 0:
                self.eval_loss = float(self.on_sync())
            return False
        self._apply_all(self.client.take())
        for f in self._due():
            if self.finished:
                break
            self.sync(f)
        return self.finished

    def _due(self) -> list[int]:
        p = len(self.fragments)
        if self.sync_every_seconds > 0:
            now, period = time.monotonic(), self.sync_every_seconds
            due = []
            for f in range(p):
                nxt = self._next_due.setdefault(f, self._t0 + period * (f + 1) / p)
                if now >= nxt:
                    due.append(f)
                    self._next_due[f] = now + period
            return due
        offsets = [((f + 1) * self.sync_every) // p for f in range(p)]  # the last is H
        return [f for f in range(p)
                if self.step >= offsets[f] and (self.step - offsets[f]) % self.sync_every == 0]

    def sync(self, fragment: int = 0) -> None:
        """Push fragment `fragment` (base − local) now; training continues meanwhile."""
        if self.client is None or self.finished:
            return
        f = fragment
        self._settle()
        while self._in_flight(f) or len(self._in_flight()) >= self.pipeline:
            # wait for the rounds in flight to commit (one per fragment, `pipeline` in all)
            got = self.client.wait(timeout=self.finish_timeout_s, need_connection=True)
            self._apply_all(got)
            self._settle()
            if self.finished or not got:
                return  # run over, or offline: the work waits for a later push
        if self.on_sync is not None:
            self.eval_loss = float(self.on_sync())
        if not self.client.connected.is_set() or f not in self.versions:
            return  # offline: the work stays in base − local for a later push
        frag = self.fragments[f]
        span = slice(frag.start, frag.stop)
        local = self._get()[span]
        prev = self.feedback.residual[span].copy()
        payload = self.feedback.encode(self.base[span] - local, offset=frag.start)
        self.seq = max(self.seq, self.client.acked_seq + 1)
        tokens, steps = self.tokens.get(f, 0), self.steps.get(f, 0)
        fut = self.client.push(payload, encoding=self.wire, base_version=self.versions[f],
                               fragment=f, numel=frag.numel, loss_tokens=tokens, steps=steps,
                               seq=self.seq,
                               train_loss=_nan(self.train_loss), eval_loss=_nan(self.eval_loss))
        self.pushed.append(_Push(f, self.seq, self.client.generation, self.base[span].copy(),
                                 prev, tokens, steps, fut))
        self.base[span] = local
        self.seq += 1
        self.pushes += 1
        self.tokens[f] = self.steps[f] = 0
        if self.blocking:
            while self._in_flight(f) and not self.finished:
                got = self.client.wait(timeout=self.finish_timeout_s, need_connection=True)
                self._apply_all(got)
                self._settle()
                if not got:
                    break

    def _in_flight(self, f: int | None = None) -> list[_Push]:
        return [p for p in self.pushed if p.accepted is not False and f in (None, p.fragment)]

    # ---- apply ------------------------------------------------------------
    def _apply_all(self, received: list[Received]) -> None:
        if not received:
            return
        self._settle(wait=True)
        local, applied = None, []
        for got in received:
            if got.version == self.versions.get(got.fragment) and not got.final:
                continue  # a rejoin re-sends the current Θ: nothing new
            frag = self.fragments[got.fragment]
            span = slice(frag.start, frag.stop)
            local = self._get() if local is None else local
            if got.final:
                local[span] = got.theta
                self.finals.add(got.fragment)
            else:
                merged = got.theta + (local[span] - self.base[span])
                if self.merge_alpha:
                    merged = self.merge_alpha * local[span] + (1 - self.merge_alpha) * merged
                local[span] = merged
            self.anchor[span] = self.base[span] = got.theta
            self.pushed = [p for p in self.pushed if p.fragment != got.fragment]
            self.versions[got.fragment] = got.version
            applied.append(got)
        if local is not None:
            self._set(local)
        self.finished = len(self.finals) == len(self.fragments)
        for got in applied if self.on_apply is not None else ():
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
        for f in {p.fragment for p in self.pushed if p.accepted is False}:
            mine = [p for p in self.pushed if p.fragment == f]
            lost = next(i for i, p in enumerate(mine) if p.accepted is False)
            undone = mine[lost:]
            frag = self.fragments[f]
            span = slice(frag.start, frag.stop)
            log.warning("push %d not held by the syncer; its work goes into the next push",
                        undone[0].seq)
            self.base[span] = undone[0].base_before
            self.feedback.residual[span] = undone[0].prev_residual
            self.tokens[f] = self.tokens.get(f, 0) + sum(p.tokens for p in undone)
            self.steps[f] = self.steps.get(f, 0) + sum(p.steps for p in undone)
            self.pushed = [p for p in self.pushed if p not in undone]

    def _outcome(self, p: _Push) -> bool | None:
        """True: the syncer holds the push; False: it does not (redo its work);
        None: unknown until the next join says (`acked_seq`)."""
        try:
            return p.future.result(timeout=300).kept
        except Refused as e:
            log.warning("push %d refused: %s", p.seq, e)
            return False
        except Lost as e:
            if self.client.generation != p.generation:
                return self.client.acked_seq >= p.seq
            log.warning("push %d: no reply (%s); the rejoin will tell", p.seq, e)
            return None
        except (TransportError, TimeoutError) as e:
            log.warning("push %d not delivered (%s)", p.seq, e)
            return False

    # ---- finish -----------------------------------------------------------
    def finish(self) -> bool:
        """Last push of every fragment, then wait for the final Θ. Returns True when
        the final weights were received (the island is then bit-identical to the syncer)."""
        if self.client is None:
            return False
        try:
            finish_sent = 0  # generation the Finish went to; a rejoin needs it again
            t0 = last_seen = time.monotonic()
            while (not self.finished and self.versions
                   and time.monotonic() - t0 < self.finish_timeout_s):
                if self.client.connected.is_set():
                    last_seen = time.monotonic()
                    self._settle()
                    todo = [f for f in range(len(self.fragments))
                            if self.steps.get(f, 0) > 0 and not self._in_flight(f)]
                    if todo and len(self._in_flight()) < self.pipeline:
                        self.sync(todo[0])  # the last work (again, if a restart lost it)
                    elif not todo and not self._in_flight() and \
                            finish_sent != self.client.generation:
                        finish_sent = self.client.generation
                        self.client.finish()
                self._apply_all(self.client.wait(timeout=1.0))
                if self.client.fatal or time.monotonic() - last_seen > self.offline_give_up_s:
                    break
            if not self.finished:
                log.warning("no final weights from the syncer; keeping local weights")
            return self.finished
        finally:
            self.client.close()


def _nan(x: float) -> float:
    return x if x is not None and math.isfinite(x) else float("nan")
