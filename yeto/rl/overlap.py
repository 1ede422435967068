"""Where a GRPO step's samples come from: drawn when the step starts, or (with
``--async-rollouts``) drawn one step ahead, while the previous step trains.

`Draws` turns a step number into its batch: the step's prompts (taken in step order,
once, so a redraw samples the same prompts) sampled from the rollout pool
(`yeto.rl.pool`). `Sampler` hands the trainer the batch of each step:

- synchronous (the default): the batch is drawn when the step asks for it, on the
  weights the nodes serve then;
- ahead (``--async-rollouts``): as soon as the batch of step t is handed over, one
  background thread ("yeto-rollout-ahead") starts drawing step t+1's, so rollouts
  for t+1 overlap training on t. At most one draw is in flight: the queue between
  the thread and the trainer holds one batch.

Staleness is measured where the batch is trained: the trainer's weights version at
that moment minus the oldest ``yeto_version`` that sampled the batch (versions are the
run's Θ commits for nodes observing the syncer; replies without a version, -1, cannot
be measured and are not bounded). A batch staler than ``max_staleness`` is dropped
and its prompts drawn again (new seeds), counted as ``stale_dropped`` in the step's
metrics; `StaleRollouts` ends the run after ``max_redraws`` stale draws in a row (the
nodes do not get the trainer's weights). The GRPO ratio exp(logp_θ − logp_behaviour),
with the nodes' logprobs as behaviour, corrects for the samples that are kept.

Every wait is bounded: the trainer waits at most ``wait_s`` for a batch, and a draw
that fails (`yeto.rl.pool.NoNodes`, a bad reply) is raised in the trainer's thread,
where the run handles it as it would a synchronous one. The thread itself only moves
jobs and results; if it dies anyway, the process ends (`yeto.signals.die_with_threads`,
which `yeto rl` installs) rather than leaving the trainer waiting.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

log = logging.getLogger("yeto.rl")

POLL_S = 1.0  # how often the idle thread looks whether it was closed


class StaleRollouts(RuntimeError):
    """The rollout nodes kept serving weights older than --max-staleness allows."""


@dataclass
class Batch:
    """The samples of one step: its prompts, a group of completions per prompt."""

    step: int
    prompts: list
    groups: list
    seconds: float = 0.0   # how long the draw took
    attempt: int = 0       # 0: the first draw of this step; n: the n-th redraw


def staleness(versions: Iterable[int], version: int) -> int | None:
    """Versions between the oldest weights that sampled (`versions`, -1 unknown) and
    the trainer's `version`; None when nothing can be measured."""
    known = [v for v in versions if v >= 0]
    return version - min(known) if known and version >= 0 else None


class Draws:
    """The batch of a step, from the pool: `draws(step, attempt) -> Batch`.

    Steps must be asked in order; the prompts of a step are taken from
    `next_prompts` on its first draw and kept for its redraws."""

    def __init__(self, pool, next_prompts: Callable[[], list], rl, seed: int):
        self.pool, self.next_prompts, self.rl, self.seed = pool, next_prompts, rl, seed
        self._prompts: dict[int, list] = {}

    def __call__(self, step: int, attempt: int) -> Batch:
        for old in [k for k in self._prompts if k < step]:
            del self._prompts[old]
        if step not in self._prompts:
            self._prompts[step] = self.next_prompts()
        prompts, rl = self._prompts[step], self.rl
        # attempt 0 keeps the synchronous trainer's seeds; a redraw gets fresh ones
        params = dict(max_tokens=rl.max_new_tokens, temperature=rl.temperature,
                      top_p=rl.top_p, seed=self.seed * 1_000_003 + step + attempt * 7_919_993)
        t0 = time.perf_counter()
        groups = self.pool.sample([p.ids for p in prompts], rl.group_size, params)
        return Batch(step, prompts, groups, time.perf_counter() - t0, attempt)


class Sampler:
    """Hands the trainer each step's batch, drawn now or one step ahead (`ahead`).

    `draw(step, attempt)` makes a batch (`Draws`); `versions(batch)` lists the
    weights versions that sampled it. With `max_staleness` None nothing is dropped."""

    def __init__(self, draw: Callable[[int, int], Batch], versions: Callable[[Batch], list],
                 *, ahead: bool, max_staleness: int | None, wait_s: float,
                 max_redraws: int = 8):
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be 0 or more, not {max_staleness}")
        self.draw, self.versions, self.ahead = draw, versions, ahead
        self.max_staleness, self.wait_s, self.max_redraws = max_staleness, wait_s, max_redraws
        self.dropped = 0  # stale batches dropped over the run
        self.last_step: int | None = None  # ahead: nothing is drawn past it (None: no end)
        self._pending: tuple[int, int] | None = None  # the job asked for, not yet taken
        self._jobs: queue.Queue = queue.Queue(maxsize=1)
        self._done: queue.Queue = queue.Queue(maxsize=1)
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        if ahead:
            self._thread = threading.Thread(target=self._work, name="yeto-rollout-ahead",
                                            daemon=True)
            self._thread.start()

    def take(self, step: int, version: int) -> tuple[Batch, dict]:
        """The batch of `step`, at most `max_staleness` versions behind `version` (the
        trainer's weights, which will train on it); ahead, the draw of `step + 1`
        starts before this returns. Also returns what the step's metrics record."""
        if self._pending is None:
            self._ask(step, 0)  # the first step (or every step, synchronous): now
        elif self._pending[0] != step:
            raise ValueError(f"step {step} asked for while step {self._pending[0]} was drawn "
                             "ahead: steps are taken in order")
        t0, dropped = time.perf_counter(), 0
        while True:
            batch = self._result()
            lag = staleness(self.versions(batch), version)
            if lag is None or self.max_staleness is None or lag <= self.max_staleness:
                break
            dropped += 1
            self.dropped += 1
            if dropped > self.max_redraws:
                raise StaleRollouts(
                    f"step {step}: {dropped} draws in a row were sampled on weights more than "
                    f"--max-staleness {self.max_staleness} versions behind the trainer "
                    f"(version {version}, the last batch {lag} behind): the rollout nodes do "
                    "not get the trainer's weights (start them with --syncer, the run's "
                    "syncer), or raise --max-staleness")
            log.info("step %d: batch sampled %d versions behind the trainer (bound %d): "
                     "dropped, drawing its prompts again", step, lag, self.max_staleness)
            self._ask(step, batch.attempt + 1)
        waited = time.perf_counter() - t0
        if self.ahead and (self.last_step is None or step < self.last_step):
            self._ask(step + 1, 0)
        return batch, dict(stale_dropped=dropped, rollout_wait_s=round(waited, 3))

    @property
    def pending_step(self) -> int | None:
        """The step whose batch is asked for and not yet taken (ahead: being drawn)."""
        return self._pending[0] if self._pending is not None else None

    def close(self) -> None:
        """Stop the thread (a draw in flight finishes on its own, its batch unused)."""
        self._closed.set()

    # ---- the thread, and the trainer's side of it -----------------------------------
    def _ask(self, step: int, attempt: int) -> None:
        self._pending = (step, attempt)
        if self.ahead:
            self._jobs.put((step, attempt), timeout=self.wait_s)

    def _result(self) -> Batch:
        step, attempt = self._pending  # type: ignore[misc]
        self._pending = None
        if not self.ahead:
            return self.draw(step, attempt)
        try:
            got, error = self._done.get(timeout=self.wait_s)
        except queue.Empty:
            alive = self._thread is not None and self._thread.is_alive()
            raise TimeoutError(f"no batch for step {step} within {self.wait_s:.0f}s from the "
                               f"rollout thread ({'still drawing' if alive else 'dead'}); "
                               "see the rollout node warnings above") from None
        if error is not None:
            raise error
        if (got.step, got.attempt) != (step, attempt):
            raise RuntimeError(f"the rollout thread drew step {got.step} (attempt "
                               f"{got.attempt}) where step {step} (attempt {attempt}) was "
                               "asked for: a bug in yeto.rl.overlap")
        return got

    def _work(self) -> None:
        while not self._closed.is_set():
            try:
                step, attempt = self._jobs.get(timeout=POLL_S)
            except queue.Empty:
                continue
            try:
                out = (self.draw(step, attempt), None)
            except Exception as e:  # noqa: BLE001 - raised again in the trainer's thread
                out = (None, e)
            while not self._closed.is_set():
                try:
                    self._done.put(out, timeout=POLL_S)
                    break
                except queue.Full:
                    continue


def sampler_for(rl, pool, next_prompts: Callable[[], list], seed: int) -> Sampler:
    """The trainer's sampler for `rl` (`yeto.rl.trainer.RLConfig`): ahead with
    ``async_rollouts``; the trainer waits for a batch as long as the pool may take."""
    bound = rl.max_staleness if rl.max_staleness is not None else (
        DEFAULT_MAX_STALENESS if rl.async_rollouts else None)
    return Sampler(Draws(pool, next_prompts, rl, seed), _versions, ahead=rl.async_rollouts,
                   max_staleness=bound, wait_s=rl.rollout_wait + 2 * rl.rollout_timeout)


DEFAULT_MAX_STALENESS = 1  # --async-rollouts without --max-staleness


def _versions(batch: Batch) -> list[int]:
    return [s.version for g in batch.groups for s in g]
