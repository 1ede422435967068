"""The adaptive grace window (`syncer/grace.py`): decisions from given push times,
so nothing here depends on a clock."""

from __future__ import annotations

import pytest

from syncer.grace import SLACK, AutoGrace


def paced(pushes: dict[str, list[tuple[float, int]]]) -> AutoGrace:
    g = AutoGrace(fallback_s=0.5)
    for learner, times in pushes.items():
        for t, tokens in times:
            g.observe(learner, 0, t, tokens)
    return g


def test_waits_for_an_equal_island_that_is_just_behind():
    # three islands push every 10 s with 1000 tokens; c is 1 s behind a and b
    g = paced({"a": [(0, 1000), (10, 1000)], "b": [(0, 1000), (10, 1000)],
               "c": [(1, 1000), (11, 1000)]})
    wait = g.wait_s(0, quorum_at=20.0, pushed={"a", "b"}, missing={"c"})
    # c is due at 21 (+ slack); worth 1000 / (2 * 100 tokens/s) = 5 s of waiting
    assert wait == pytest.approx(1 + 10 * SLACK)


def test_does_not_wait_for_an_island_three_times_slower():
    g = paced({"a": [(0, 1000), (10, 1000)], "b": [(0, 1000), (10, 1000)],
               "slow": [(0, 1000), (30, 1000)]})
    # the slow island is due at 60: 40 s after the quorum, worth only 5 s
    assert g.wait_s(0, quorum_at=20.0, pushed={"a", "b"}, missing={"slow"}) == 0.0


def test_an_island_with_more_tokens_is_worth_a_longer_wait():
    base = {"a": [(0, 1000), (10, 1000)], "b": [(0, 1000), (10, 1000)]}
    small = paced(dict(base, c=[(0, 1000), (14, 1000)]))
    big = paced(dict(base, c=[(0, 8000), (14, 8000)]))
    args = dict(quorum_at=20.0, pushed={"a", "b"}, missing={"c"})
    assert small.wait_s(0, **args) == 0.0  # due at 28 + slack: 8 s > 5 s of worth
    assert big.wait_s(0, **args) == pytest.approx(8 + 14 * SLACK)  # worth 40 s


def test_unmeasured_islands_get_the_fixed_grace():
    g = paced({"a": [(0, 1000)], "b": [(0, 1000), (10, 1000)]})
    assert g.wait_s(0, quorum_at=10.0, pushed={"a"}, missing={"b"}) == 0.5  # a: one push
    assert g.wait_s(0, quorum_at=10.0, pushed={"b"}, missing={"new"}) == 0.5
    assert g.wait_s(0, quorum_at=10.0, pushed={"b"}, missing=set()) == 0.0


def test_fragments_are_paced_apart():
    g = AutoGrace(fallback_s=0.5)
    for t in (0, 10):
        g.observe("a", 0, t, 100)
        g.observe("b", 0, t + 1, 100)
    g.observe("a", 1, 5, 100)  # fragment 1: one push only, so nothing measured yet
    assert g.wait_s(1, quorum_at=12.0, pushed={"a"}, missing={"b"}) == 0.5
    assert g.wait_s(0, quorum_at=20.0, pushed={"a"}, missing={"b"}) == pytest.approx(2.0)
