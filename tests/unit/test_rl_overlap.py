"""Asynchronous rollouts (`yeto.rl.overlap`): the batch of step t+1 is drawn in a
background thread while step t trains, batches come in step order, a batch sampled
more than --max-staleness versions behind the trainer is dropped and drawn again
(counted; bounded), a failed draw is raised in the trainer's thread, and the trainer's
wait is bounded. The source here is a real in-process one whose draws are gated by
events: the test decides when a draw may finish and which weights version samples it.

Here: the checks that need no process, server or training (an async GRPO run against
a real rollout node: tests/integration/test_rl_overlap.py)."""


import threading

import pytest

from yeto.rl.cli import build_parser, rl_config
from yeto.rl.overlap import Batch, Sampler, StaleRollouts, staleness
from yeto.rl.pool import NoNodes

WAIT = 30.0  # a bound on every wait below, never a measure of speed


class GatedSource:
    """Draws whose start the test can see and whose end it releases: `draw(step,
    attempt)` records itself, waits for `release(step, attempt)` (when gated), and
    returns a batch sampled by the weights version `self.version` had when it started."""

    def __init__(self, gated: bool = True):
        self.gated, self.version = gated, 0
        self.calls: list[tuple[int, int, str]] = []
        self.fail: Exception | None = None
        self._started: dict[tuple, threading.Event] = {}
        self._go: dict[tuple, threading.Event] = {}
        self._lock = threading.Lock()

    def _event(self, table: dict, key: tuple) -> threading.Event:
        with self._lock:
            return table.setdefault(key, threading.Event())

    def __call__(self, step: int, attempt: int) -> Batch:
        self.calls.append((step, attempt, threading.current_thread().name))
        version = self.version  # the weights that sample: those served when it starts
        self._event(self._started, (step, attempt)).set()
        if self.gated and not self._event(self._go, (step, attempt)).wait(WAIT):
            raise AssertionError(f"draw {step}/{attempt} was never released")
        if self.fail is not None:
            raise self.fail
        return Batch(step, [f"prompt-{step}"], [[version, version]], attempt=attempt)

    def started(self, step: int, attempt: int = 0) -> bool:
        return self._event(self._started, (step, attempt)).wait(WAIT)

    def release(self, step: int, attempt: int = 0) -> None:
        self._event(self._go, (step, attempt)).set()

    def open(self) -> None:
        """Every draw, waiting or to come, finishes (the tests' teardown)."""
        self.gated = False
        with self._lock:
            for e in self._go.values():
                e.set()


def _sampler(source, *, ahead=True, max_staleness=None, wait_s=WAIT, max_redraws=8):
    return Sampler(source, lambda b: [v for g in b.groups for v in g], ahead=ahead,
                   max_staleness=max_staleness, wait_s=wait_s, max_redraws=max_redraws)


def _take(sampler, step, version, out: list):
    """`sampler.take` on another thread (the trainer), its result appended to `out`."""
    t = threading.Thread(target=lambda: out.append(sampler.take(step, version)))
    t.start()
    return t


def test_staleness_counts_versions_from_the_oldest_known_sampler():
    assert staleness([3, 2, 3], 5) == 3
    assert staleness([5], 5) == 0
    assert staleness([6], 5) == -1  # a node can hold a Θ the trainer has not applied yet
    assert staleness([-1, 4], 5) == 1  # -1: a reply without yeto_version
    assert staleness([-1, -1], 5) is None and staleness([2], -1) is None


def test_ahead_draws_the_next_step_while_this_one_trains_in_step_order():
    source = GatedSource()
    sampler = _sampler(source)
    try:
        source.release(1)
        batch, info = sampler.take(1, 0)
        assert batch.step == 1 and batch.prompts == ["prompt-1"] and info["stale_dropped"] == 0
        # step 1 is in the trainer's hands; the draw of step 2 has started in the thread
        assert sampler.pending_step == 2 and source.started(2)
        got: list = []
        taker = _take(sampler, 2, 0, got)
        source.release(2)
        taker.join(WAIT)
        assert [b.step for b, _ in got] == [2] and source.started(3)
        assert [c[:2] for c in source.calls] == [(1, 0), (2, 0), (3, 0)]
        assert {c[2] for c in source.calls} == {"yeto-rollout-ahead"}
        with pytest.raises(ValueError, match="in order"):
            sampler.take(5, 0)  # step 3 is being drawn
        sampler.last_step = 4  # the run's last step: nothing is drawn past it
        source.release(3)
        sampler.take(3, 0)
        assert sampler.pending_step == 4
        source.release(4)
        sampler.take(4, 0)
        assert sampler.pending_step is None
    finally:
        source.open()
        sampler.close()


def test_synchronous_draws_each_step_when_it_is_taken_in_the_callers_thread():
    source = GatedSource(gated=False)
    sampler = _sampler(source, ahead=False, max_staleness=None)
    for step in (1, 2, 3):
        batch, info = sampler.take(step, 0)
        assert batch.step == step and info["stale_dropped"] == 0
        assert [c[:2] for c in source.calls] == [(s, 0) for s in range(1, step + 1)]
    assert {c[2] for c in source.calls} == {threading.current_thread().name}


def test_a_batch_staler_than_the_bound_is_dropped_and_its_prompts_drawn_again():
    source = GatedSource()
    sampler = _sampler(source, max_staleness=1)
    try:
        source.release(1)
        sampler.take(1, 0)
        assert source.started(2)  # drawn on version 0 ...
        source.version = 2        # ... the weights move on meanwhile (two commits)
        source.release(2)
        got: list = []
        taker = _take(sampler, 2, 2, got)  # the trainer is at version 2: staleness 2 > 1
        assert source.started(2, attempt=1)  # dropped, drawn again
        assert not got and (3, 0) not in [c[:2] for c in source.calls]
        source.release(2, attempt=1)
        taker.join(WAIT)
        (batch, info), = got
        assert (batch.step, batch.attempt, batch.groups) == (2, 1, [[2, 2]])
        assert info["stale_dropped"] == 1 and sampler.dropped == 1
        assert source.started(3)  # only then the next step is drawn ahead
        source.release(3)
        batch, info = sampler.take(3, 3)  # one version behind: within the bound, kept
        assert batch.attempt == 0 and info["stale_dropped"] == 0
    finally:
        source.open()
        sampler.close()


def test_nodes_that_stay_stale_end_the_run_after_the_bounded_redraws():
    source = GatedSource(gated=False)  # always samples version 0
    sampler = _sampler(source, ahead=False, max_staleness=0, max_redraws=2)
    with pytest.raises(StaleRollouts, match="--max-staleness 0"):
        sampler.take(1, 3)
    assert [c[:2] for c in source.calls] == [(1, 0), (1, 1), (1, 2)]
    assert sampler.dropped == 3


def test_a_failed_draw_is_raised_in_the_trainers_thread():
    source = GatedSource(gated=False)
    sampler = _sampler(source)
    try:
        sampler.take(1, 0)
        source.fail = NoNodes("no rollout node answered")
        with pytest.raises(NoNodes, match="no rollout node"):
            sampler.take(2, 0)
    finally:
        source.open()
        sampler.close()


def test_the_trainers_wait_for_a_batch_is_bounded():
    source = GatedSource()  # the draw of step 1 is never released in time
    sampler = _sampler(source, wait_s=0.05)
    try:
        with pytest.raises(TimeoutError, match="no batch for step 1 .*still drawing"):
            sampler.take(1, 0)
    finally:
        source.open()
        sampler.close()


def test_the_flags():
    base = ["--model", "m", "--data", "d", "--rollout-url", "http://127.0.0.1:1/v1"]
    rl = rl_config(build_parser().parse_args(base + ["--async-rollouts", "--max-staleness",
                                                     "2"]))
    assert rl.async_rollouts and rl.max_staleness == 2
    rl = rl_config(build_parser().parse_args(base))
    assert not rl.async_rollouts and rl.max_staleness is None
    for bad, why in ((["--max-staleness", "-1"], "0 or more"),
                     (["--async-rollouts", "--update-nodes"], "does not work with")):
        with pytest.raises(SystemExit, match=why):
            rl_config(build_parser().parse_args(base + bad))
