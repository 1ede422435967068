"""yeto.testing.reference_diloco (DiLoCo's Algorithm 1 in plain torch): the parts that
need no training (the runs themselves, and scripts/compare_torchft.py's defaults:
tests/e2e/test_reference_diloco.py)."""


from __future__ import annotations

import numpy as np
import pytest

from yeto.testing import reference_diloco as rd


def _cases(*argv: str) -> dict[str, rd.Case]:
    return rd.parse_cases(rd.build_parser().parse_args(["--model", "m", "--data", "d", *argv]))


def test_cases_change_the_flags_they_name():
    cases = _cases("--islands", "4", "--case", "a:", "--case",
                   "b:tuning=full,outer_lr=0.7,q4=1,overlap=2")
    assert cases["a"] == rd.Case(model="m", data="d", islands=4)
    b = cases["b"]
    assert (b.tuning, b.outer_lr, b.q4, b.overlap, b.islands) == ("full", 0.7, True, 2, 4)
    assert list(_cases()) == ["run"]


def test_a_case_with_an_unknown_key_is_refused_with_the_keys_there_are():
    with pytest.raises(SystemExit, match="'islandz=4' is not KEY=VALUE with KEY one of .*"
                                         "islands"):
        _cases("--case", "x:islandz=4")


def test_theta_rel_is_each_tensors_largest_difference_over_its_largest_value():
    b = {"w": np.array([2.0, -4.0], np.float32), "zero": np.zeros(2, np.float32)}
    a = {"w": np.array([2.0, -4.002], np.float32), "zero": np.array([0.0, 1e-9], np.float32)}
    assert rd.theta_rel(a, b) == pytest.approx(0.002 / 4, rel=1e-3)
    assert rd.theta_rel(b, b) == 0.0


def test_round_losses_are_the_losses_at_each_push():
    trace = rd.Trace(losses={"island-0": {s: float(s) for s in range(1, 7)}})
    assert rd.round_losses(trace, rd.Case(rounds=3, sync_every=2)) == \
        {"island-0": [2.0, 4.0, 6.0]}

