"""`python -m yeto.sim`: a fleet in one process computes what real processes compute.

Here: the checks that need no process, server or training (the others:
tests/e2e/test_sim.py)."""


from __future__ import annotations

import re
import threading

import numpy as np


def test_speeds_give_every_island_the_same_wall_time(tmp_path):
    """--speeds 1,3: the slow island's steps take 3x as long, so it trains a third of
    --max-steps and both islands stop at about the same time."""
    from yeto.config import IslandConfig
    from yeto.sim.fleet import island_configs

    base = IslandConfig(model="m", max_steps=90)
    cfgs = island_configs(base, 2, tmp_path, [1.0, 3.0])
    assert [(c.learner_id, c.slowdown, c.max_steps) for c in cfgs] == \
        [("island-0", 1.0, 90), ("island-1", 3.0, 30)]
    assert [c.max_steps for c in island_configs(base, 2, tmp_path, [])] == [90, 90]


# ---- simulated time (--step-seconds) ---------------------------------------------
def _islands_on(clock, bodies: dict) -> None:
    clock.expect(list(bodies))
    threads = [threading.Thread(target=fn, name=name) for name, fn in bodies.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()


def test_virtual_clock_runs_steps_in_order_of_simulated_time():
    """Islands of step cost 1 and 3: whatever the threads' real speed, each step runs
    when no other island's step ends before it (ties: by name), so the events the
    islands emit come in the order of simulated time."""
    from yeto.sim.clock import VirtualClock

    clock, events = VirtualClock(), []

    def island(cost: float, steps: int):
        def body():
            for _ in range(steps):
                clock.step(cost)
                events.append((clock.now(), threading.current_thread().name))
            clock.leave()
        return body

    _islands_on(clock, {"a": island(1.0, 9), "b": island(3.0, 3)})
    assert events == sorted(events)  # by time, then name
    assert [t for t, n in events if n == "b"] == [3.0, 6.0, 9.0]
    assert clock.goodput() == {"a": 1.0, "b": 1.0}


def test_virtual_clock_counts_a_wait_for_the_syncer_as_waiting():
    """Island a waits for a broadcast that island b's commit at time 5 sends: a steps
    aside meanwhile (b is not held back by it), resumes at 5, and the 4 simulated
    seconds it waited count against its goodput, not the time it trained."""
    from yeto.sim.clock import VirtualClock

    clock, arrived, resumed = VirtualClock(), threading.Event(), []

    def a():
        clock.step(1.0)
        with clock.waiting():
            assert arrived.wait(30)
        resumed.append(clock.now())
        clock.step(1.0)
        clock.leave()

    def b():
        for _ in range(5):
            clock.step(1.0)
        clock.committed(0, 1)  # the syncer publishes version 1 at b's time, 5
        for name in ("b", "a"):
            clock.delivered(name, 0, 1)
        arrived.set()
        clock.leave()

    _islands_on(clock, {"a": a, "b": b})
    assert resumed == [5.0]
    assert clock.waited == {"a": 4.0, "b": 0.0}
    assert clock.goodput() == {"a": 2.0 / 6.0, "b": 1.0}


def test_step_costs_vary_within_the_jitter_and_repeat_per_seed():
    from itertools import islice

    from yeto.sim.fleet import step_costs

    assert list(islice(step_costs(0.125, 0.0, "3/island-0"), 4)) == [0.125] * 4
    one = list(islice(step_costs(0.1, 0.5, "3/island-0"), 2000))
    assert one == list(islice(step_costs(0.1, 0.5, "3/island-0"), 2000))
    assert one != list(islice(step_costs(0.1, 0.5, "3/island-1"), 2000))
    assert 0.05 <= min(one) < 0.055 and 0.145 < max(one) <= 0.15
    assert abs(np.mean(one) - 0.1) < 0.005  # mean step cost stays S x speed


def test_bad_fleet_flags_are_refused_with_the_fix():
    import pytest

    from yeto.config import ConfigError
    from yeto.sim.__main__ import build_parser, configs

    base = ["--model", "m", "--data", "d.jsonl"]
    for extra, says in [(["--islands", "0"], "--islands must be at least 1"),
                        (["--speeds", "1,2,3"], "--speeds has 3 values for 2 islands"),
                        (["--step-seconds", "-1"], "--step-seconds must be >= 0"),
                        (["--step-seconds", "0.1", "--step-jitter", "1"], "in [0, 1)"),
                        (["--step-jitter", "0.1"], "needs --step-seconds")]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            configs(build_parser().parse_args(base + extra))
