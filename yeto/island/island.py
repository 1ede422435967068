"""`Island`: the state machine that coordinates an island's parts over its weights:
a push ledger (counters, pushes in flight, settle, carry forward), a delta encoder
(anchor, error feedback), an applier (Θ into the weights) and a schedule (when each
fragment is due), through the transport (`yeto.transport.Transport`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor

from yeto.codec import Q4_BLOCK
from yeto.island.applier import Applier
from yeto.island.encoder import DeltaEncoder, Inline, default_threads
from yeto.island.ledger import PUSH_TIMEOUT_S, PushLedger
from yeto.island.schedule import Schedule
from yeto.island.staging import Stager
from yeto.island.weights import WeightPasses
from yeto.layout import Fragment
from yeto.transport import CARRY_SLACK, Received, Refused, Transport

log = logging.getLogger("yeto.island")

CHUNK = 1 << 20  # values per piece of a pass over the weights (4 MiB of f32)


class Island:
    """An island over `weights` (a `yeto.island.Weights`) and `client` (None: a single
    island, which pushes nothing). `on_sync()` evaluates before each push and returns
    the eval loss; `on_apply(got)` follows each applied broadcast. `overlap`: a push's
    encode and send run on a background thread while training goes on (the training
    loop waits only for `DeltaEncoder.stage`, and with the guard, `before_update`, not
    even for that: `yeto.island.staging`); default: when the transport sends in the
    background (`background_pushes`; `yeto.sim` on simulated time does not)."""

    def __init__(self, weights, *, client: Transport | None,
                 sync_every: int = 50, sync_every_seconds: float = 0.0, wire: str = "q4",
                 blocking: bool = False, merge_alpha: float = 0.0, pipeline: int = 1,
                 on_sync: Callable[[], float] | None = None,
                 on_apply: Callable[[Received], None] | None = None,
                 start_timeout_s: float | None = None, connect_grace_s: float = 5.0,
                 finish_timeout_s: float = 1800.0, offline_give_up_s: float = 60.0,
                 chunk: int = CHUNK, threads: int | None = None,
                 clock: Callable[[], float] = time.monotonic, overlap: bool | None = None):
        if sync_every < 1:
            raise ValueError("sync_every must be >= 1")
        if not 0.0 <= merge_alpha < 1.0:
            raise ValueError("merge_alpha must be in [0, 1)")
        if chunk < Q4_BLOCK or chunk % Q4_BLOCK:
            raise ValueError(f"chunk must be a positive multiple of {Q4_BLOCK}")
        self.layout, self.client = weights.layout, client
        self.passes = WeightPasses(weights)
        # threads that encode a push (training waits for it): the island's cores
        threads = max(1, threads if threads is not None else default_threads())
        self.encoder = DeltaEncoder(self.layout.numel, wire, int(chunk), threads)
        self.ledger = PushLedger(client, self.encoder, 0 if sync_every_seconds > 0 else
                                 CARRY_SLACK * sync_every)
        self.applier = Applier(self.encoder, merge_alpha, int(chunk))
        self.schedule = Schedule(sync_every, sync_every_seconds, clock)
        self.blocking, self.pipeline = blocking, max(1, pipeline)
        if overlap is None:
            overlap = client is not None and client.background_pushes
        self.overlapped = bool(overlap and client is not None)
        self.executor = (ThreadPoolExecutor(1, thread_name_prefix="yeto-push-encode")
                         if self.overlapped else Inline())
        self.stager = Stager(self.passes, self.encoder, self.ledger, self.overlapped)
        # per push: seconds the training loop waited for it (the push, then the guard)
        self.blocked_s: list[float] = []
        self.on_sync, self.on_apply = on_sync, on_apply
        self.start_timeout_s, self.connect_grace_s = start_timeout_s, connect_grace_s
        self.finish_timeout_s, self.offline_give_up_s = finish_timeout_s, offline_give_up_s
        self.versions: dict[int, int] = {}   # fragment -> version of its anchor
        self.finals: set[int] = set()        # fragments whose final weights arrived
        self.step = self.total_tokens = 0
        self.finished = False
        self.train_loss = self.eval_loss = float("nan")

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

    @property
    def pushes(self) -> int:
        """Pushes sent so far."""
        return self.ledger.pushes

    # ---- start ------------------------------------------------------------
    def start(self) -> None:
        """Join the run and adopt its Θ; trains locally if the syncer is unreachable.
        A single island (no client) pushes nothing and keeps no anchor."""
        if self.client is None:
            return
        self.encoder.anchor = self.passes.read_all(self.layout.numel, self.encoder.chunk)
        self.client.stream_broadcasts()
        self.client.start(self.encoder.anchor)
        self._wait_for_theta()
        self.schedule.restart()

    def _wait_for_theta(self) -> None:
        t0 = last_log = time.monotonic()
        while True:
            self._apply_all(self.client.wait(timeout=1.0))
            if len(self.versions) == len(self.fragments):
                return
            if self.client.fatal:
                raise Refused(self.client.fatal)
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
    def guard_updates(self, install: Callable[[Callable[[], None]], bool] | None) -> None:
        """`install(before_update)` hooks the guard into the training loop, right before
        every change the loop makes to the weights (e.g. a torch optimizer's
        `register_step_pre_hook`), and returns True when it did; from then on pushes are
        staged in the background too (`yeto.island.staging`). None: no guard."""
        self.stager.guarded = bool(install is not None and install(self.before_update))

    def before_update(self) -> None:
        """The guard: call right before the training loop changes the weights (optimizer
        step, update); waits for a push still reading them. Costs nothing otherwise."""
        waited = self.stager.wait()
        if waited and self.blocked_s:
            self.blocked_s[-1] += waited

    def after_step(self, loss_tokens: int, train_loss: float | None = None) -> bool:
        """Call once per optimizer step. Applies arrived weights, pushes when due.
        Returns True when the run is over (the final weights are loaded)."""
        self.before_update()  # a loop without the guard, or one that skipped it
        self.step += 1
        self.total_tokens += int(loss_tokens)
        self.ledger.count(len(self.fragments), loss_tokens)
        if train_loss is not None:
            self.train_loss = float(train_loss)
        if self.client is None:  # a single island: still evaluate every H steps
            if self.on_sync is not None and self.step % self.schedule.sync_every == 0:
                self.eval_loss = float(self.on_sync())
            return False
        self._apply_all(self.client.take())
        for f in self.schedule.due(self.step, len(self.fragments)):
            if self.finished:
                break
            self.sync(f)
        return self.finished

    def sync(self, fragment: int = 0) -> None:
        """Push fragment `fragment` (anchor − local) now; training continues meanwhile."""
        if self.client is None or self.finished:
            return
        self.before_update()
        f = fragment
        if not self._room_for(f):
            return  # run over, or offline: the work waits for a later push
        if self.on_sync is not None:
            self.eval_loss = float(self.on_sync())
        if not self.client.connected.is_set() or f not in self.versions:
            return  # offline: the work stays in anchor − local for a later push
        frag, t0 = self.fragments[f], time.perf_counter()
        push = self.ledger.send(frag, f, self.stager.prepare(frag), self.versions[f],
                                self.train_loss, self.eval_loss, self.executor)
        self.stager.sent(push)
        self.blocked_s.append(time.perf_counter() - t0)
        if self.blocking:  # its reply first: a refused push has no Θ to wait for
            futures.wait([push.future], timeout=PUSH_TIMEOUT_S)
            self._settle()
            while self.ledger.in_flight(f) and not self.finished:
                if not self._wait_and_apply():
                    break

    def _room_for(self, f: int) -> bool:
        """Wait for the rounds in flight to commit (one per fragment, `pipeline` in all);
        False when the run ended or the syncer went away meanwhile."""
        self._settle()
        while self.ledger.in_flight(f) or len(self.ledger.in_flight()) >= self.pipeline:
            if not self._wait_and_apply() or self.finished:
                return False
        return True

    def _wait_and_apply(self) -> bool:
        """Wait for a broadcast (while connected) and apply it; False when none came."""
        got = self.client.wait(timeout=self.finish_timeout_s, need_connection=True)
        self._apply_all(got)
        self._settle()
        return bool(got)

    def _settle(self, wait: bool = False, only: set[int] | None = None) -> None:
        self.ledger.settle(self.fragments, wait, only)

    # ---- apply ------------------------------------------------------------
    def _apply_all(self, received: list[Received]) -> None:
        if not received:
            return
        self.before_update()  # no staging may read the weights or the anchor meanwhile
        self._settle(wait=True, only={got.fragment for got in received})
        applied = []
        with self.passes.open() as w:
            for got in received:
                f = got.fragment
                if not self.applier.wanted(got, self.versions.get(f)):
                    continue
                if not self.applier.apply(got, self.fragments[f], w, f not in self.versions):
                    continue
                if got.final:
                    self.finals.add(f)
                self.ledger.applied(f)
                self.versions[f] = got.version
                applied.append(got)
        self.finished = len(self.finals) == len(self.fragments)
        for got in applied if self.on_apply is not None else ():
            self.on_apply(got)

    # ---- finish -----------------------------------------------------------
    def finish(self) -> bool:
        """Last push of every fragment, then wait for the final Θ. Returns True when
        the final weights were received (the island is then bit-identical to the syncer)."""
        if self.client is None:
            return False
        try:
            self.before_update()
            finish_sent = 0  # generation the Finish went to; a rejoin needs it again
            t0 = last_seen = time.monotonic()
            while (not self.finished and self.versions
                   and time.monotonic() - t0 < self.finish_timeout_s):
                if self.client.connected.is_set():
                    last_seen = time.monotonic()
                    finish_sent, committed = self._wind_down(finish_sent)
                    if committed:
                        continue  # its round committed already: say Finish at once
                self._apply_all(self.client.wait(timeout=1.0))
                if self.client.fatal or time.monotonic() - last_seen > self.offline_give_up_s:
                    break
            if not self.finished:
                log.warning("no final weights from the syncer; keeping local weights")
            return self.finished
        finally:
            self.executor.shutdown(wait=True)
            self.client.close()

    def _wind_down(self, finish_sent: int) -> tuple[int, bool]:
        """One turn of finishing while connected: push the last work of a fragment (again,
        if a restart lost it), or, once nothing is owed or in flight, say Finish (once per
        generation: a rejoin needs it again). Returns the generation the Finish went to,
        and True when a blocking push's round committed already."""
        self._settle()
        todo = [f for f in range(len(self.fragments))
                if self.ledger.owes(f) and not self.ledger.in_flight(f)]
        if todo and len(self.ledger.in_flight()) < self.pipeline:
            pushes = self.pushes
            self.sync(todo[0])
            return finish_sent, (self.blocking and self.pushes > pushes
                                 and not self.ledger.in_flight())
        if not todo and not self.ledger.in_flight() and finish_sent != self.client.generation:
            finish_sent = self.client.generation
            self.client.finish()
        return finish_sent, False
