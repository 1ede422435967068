"""One worker thread owns the engine: batches, weight changes and adapter loads.

Requests that are queued together are sampled as one batch (up to `max_batch`
rows; a request is never split). Weights never change during a batch: new Θ from
the syncer (`offer`) and adapter loads (`call`) wait in the queue and run between
batches, so every request is served entirely by one weights version, and its
reply says which (`version`)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from yeto.rollout.generate import Output, Row, generate

log = logging.getLogger("yeto.rollout")


@dataclass
class Served:
    """What one request got: an output per row, and the weights version that made them."""

    outputs: list[Output]
    version: int


@dataclass
class _Job:
    rows: list[Row]
    future: Future


class Scheduler:
    def __init__(self, engine, eos_ids: Sequence[int], detok: Callable[[list[int]], str],
                 max_batch: int = 64, version: int = 0):
        self.engine, self.eos_ids, self.detok = engine, list(eos_ids), detok
        self.max_batch = max(1, max_batch)
        self.version = version
        self.requests = self.rows_served = self.tokens_out = self.batches = 0
        self.busy_s = 0.0
        self._jobs: deque[_Job] = deque()
        self._calls: deque[tuple[Callable, Future]] = deque()
        self._offered: tuple[int, np.ndarray] | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="yeto-rollout")
        self._thread.start()

    # ---- callers (any thread) ---------------------------------------------------
    def submit(self, rows: list[Row]) -> Future:
        """Sample `rows` (one request); the future gives a `Served`."""
        fut: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the rollout node is shutting down")
            self._jobs.append(_Job(rows, fut))
            self._cond.notify_all()
        return fut

    def offer(self, flat: np.ndarray, version: int) -> None:
        """New weights (version `version`), applied before the next batch; a newer
        offer replaces one not yet applied."""
        with self._cond:
            self._offered = (version, flat)
            self._cond.notify_all()

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the worker between batches (e.g. loading an adapter)."""
        fut: Future = Future()
        with self._cond:
            self._calls.append((fn, fut))
            self._cond.notify_all()
        return fut

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    # ---- the worker -------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._jobs or self._calls
                                    or self._offered is not None)
                if self._closed:
                    break
                offered, self._offered = self._offered, None
                calls, self._calls = list(self._calls), deque()
                jobs = self._take_jobs()
            if offered is not None:
                self._apply(*offered)
            for fn, fut in calls:
                _settle(fut, fn)
            if jobs:
                self._serve(jobs)
        with self._cond:
            for job in self._jobs:
                job.future.set_exception(RuntimeError("the rollout node shut down"))

    def _take_jobs(self) -> list[_Job]:
        jobs, rows = [], 0
        while self._jobs and (not jobs or rows + len(self._jobs[0].rows) <= self.max_batch):
            job = self._jobs.popleft()
            jobs.append(job)
            rows += len(job.rows)
        return jobs

    def _apply(self, version: int, flat: np.ndarray) -> None:
        try:
            self.engine.set_weights(flat)
            self.version = version
            log.info("weights version %d applied", version)
        except Exception:  # noqa: BLE001 - bad weights must not stop the node serving
            log.exception("applying weights version %d failed; still serving version %d",
                          version, self.version)

    def _serve(self, jobs: list[_Job]) -> None:
        rows = [r for job in jobs for r in job.rows]
        t0 = time.perf_counter()
        try:
            outputs = generate(self.engine, rows, self.eos_ids, self.detok)
        except Exception as e:  # noqa: BLE001 - the request fails, the node keeps serving
            log.exception("generation failed")
            for job in jobs:
                job.future.set_exception(e)
            return
        self.busy_s += time.perf_counter() - t0
        self.batches += 1
        self.requests += len(jobs)
        self.rows_served += len(rows)
        self.tokens_out += sum(len(o.token_ids) for o in outputs)
        at = 0
        for job in jobs:
            job.future.set_result(Served(outputs[at:at + len(job.rows)], self.version))
            at += len(job.rows)


def _settle(fut: Future, fn: Callable[[], object]) -> None:
    try:
        fut.set_result(fn())
    except Exception as e:  # noqa: BLE001 - handed to the caller
        fut.set_exception(e)
