"""yeto's outer loop is DiLoCo's Algorithm 1, round for round.

yeto.testing.reference_diloco is DiLoCo written from the paper in plain torch (k
replicas, H AdamW steps each, δᵢ = Θ − θᵢ, the mean of the δᵢ, an outer SGD step:
plain averaging, or Nesterov at lr 0.7, momentum 0.9); it shares only the data
loading with yeto. It runs each case, then the same case through `yeto.sim`
(`--blocking-sync`, f32 both ways, `--merge uniform`) on the same batches. Each
island's training loss at every push, Θ after every round (and at the start) and the
syncer's final weights file agree with the reference to 1e-5, relative.

Where yeto means to differ (the token-weighted merge, its default; the q4 wire, its
default; islands that train on while a round commits, its default), yeto agrees
with the reference that makes that departure, and is far from Algorithm 1 itself:
the difference is that departure and nothing else.

Both sides run in a process of their own (`python -m yeto.testing.reference_diloco`):
an in-process sim inside pytest was once seen to change what later tests computed."""


from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from yeto.testing import reference_diloco as rd

ROOT = Path(__file__).resolve().parents[2]

TOL = 1e-5  # relative: of a round's loss; of a tensor, to the largest value in it
NESTEROV = "outer_lr=0.7,outer_momentum=0.9"
# Algorithm 1 cases, as changes to the script's defaults: LoRA (r 4) or full weights, k
# islands, 3 rounds of H = 5 AdamW steps, plain averaging (outer lr 1, momentum 0) or
# Nesterov. Two cover every choice once; the other six are slow.
ALGORITHM_1 = {"lora-nesterov-k2": NESTEROV, "full-average-k4": "tuning=full,islands=4"}
MORE_OF_ALGORITHM_1 = {
    "lora-average-k2": "", "lora-average-k4": "islands=4",
    "lora-nesterov-k4": f"islands=4,{NESTEROV}", "full-average-k2": "tuning=full",
    "full-nesterov-k2": f"tuning=full,{NESTEROV}",
    "full-nesterov-k4": f"tuning=full,islands=4,{NESTEROV}",
}
# yeto's intended departures, each over lora-nesterov-k2 (the reference follows it)
DEPARTURES = {"token-weights": "token_weights=1", "q4": "q4=1", "overlap": "overlap=1"}
# longer runs, the reference's Nesterov step in the syncer's float32 order (slow)
BIT_FOR_BIT = {"lora-nesterov-k2-8-rounds": f"rounds=8,{NESTEROV},yeto_rounding=1",
               "full-nesterov-k2-8-rounds": f"tuning=full,rounds=8,{NESTEROV},yeto_rounding=1"}


def _run(model: Path, task, out: Path, cases: dict[str, str]) -> Path:
    """The reference with --yeto over `cases` (name: changes), into `out`."""
    argv = [a for name, changes in cases.items() for a in ("--case", f"{name}:{changes}")]
    r = subprocess.run([sys.executable, "-m", "yeto.testing.reference_diloco",
                        "--model", str(model), "--data", str(task[0]), "--yeto",
                        "--out", str(out), *argv],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1].startswith("RESULT max_loss_rel="), r.stdout
    return out


@pytest.fixture(scope="module")
def default_run(tiny_llama, tiny_task, tmp_path_factory) -> Path:
    cases = {**ALGORITHM_1, **{n: f"{NESTEROV},{c}" for n, c in DEPARTURES.items()}}
    return _run(tiny_llama, tiny_task, tmp_path_factory.mktemp("reference"), cases)


@pytest.fixture(scope="module")
def slow_run(tiny_llama, tiny_task, tmp_path_factory) -> Path:
    return _run(tiny_llama, tiny_task, tmp_path_factory.mktemp("reference-slow"),
                {**MORE_OF_ALGORITHM_1, **BIT_FOR_BIT})


def _case(changes: str) -> rd.Case:
    args = rd.build_parser().parse_args(["--model", "m", "--data", "d", "--case",
                                         f"c:{changes}"])
    return rd.parse_cases(args)["c"]


def _traces(out: Path, name: str) -> tuple[rd.Trace, rd.Trace]:
    return rd.Trace.load(out / name, "reference"), rd.Trace.load(out / name, "yeto")


def _assert_close(a: dict[str, np.ndarray], b: dict[str, np.ndarray], what: str) -> None:
    assert a.keys() == b.keys(), what
    for name, y in b.items():
        scale = float(np.abs(y).max())
        np.testing.assert_allclose(a[name], y, rtol=0, atol=TOL * scale, err_msg=f"{what} {name}")


def _assert_same_run(ref: rd.Trace, yeto: rd.Trace, case: rd.Case, final_file: Path) -> None:
    """Same batches (loss tokens per island and round), each round's loss at each push,
    Θ at the start and after each round, and the final weights file."""
    assert yeto.tokens == ref.tokens
    want, got = rd.round_losses(ref, case), rd.round_losses(yeto, case)
    assert got.keys() == want.keys() and len(got) == case.islands
    for island in want:
        np.testing.assert_allclose(got[island], want[island], rtol=TOL, atol=0, err_msg=island)
    rounds = [str(t) for t in range(case.rounds + 1)]
    assert sorted(yeto.thetas) == sorted(ref.thetas) == sorted([*rounds, "final"])
    for when in yeto.thetas:
        _assert_close(yeto.thetas[when], ref.thetas[when], f"theta after round {when}:")
    _assert_close(load_file(str(final_file)), ref.thetas["final"], "the syncer's final file:")
    moved = rd.theta_rel(ref.thetas["final"], ref.thetas["0"])
    assert moved > 1e3 * TOL  # training moved Θ, far beyond the tolerance


def _final_file(out: Path, name: str, case: rd.Case) -> Path:
    weights = "adapter_model.safetensors" if case.tuning == "lora" else "model.safetensors"
    return out / name / "sim" / "syncer" / "final" / weights


@pytest.mark.parametrize("name", ALGORITHM_1)
def test_yeto_is_algorithm_1(default_run, name):
    case = _case(ALGORITHM_1[name])
    _assert_same_run(*_traces(default_run, name), case, _final_file(default_run, name, case))


@pytest.mark.slow
@pytest.mark.parametrize("name", MORE_OF_ALGORITHM_1)
def test_yeto_is_algorithm_1_in_every_case(slow_run, name):
    case = _case(MORE_OF_ALGORITHM_1[name])
    _assert_same_run(*_traces(slow_run, name), case, _final_file(slow_run, name, case))


@pytest.mark.parametrize("name", DEPARTURES)
def test_yeto_departs_from_algorithm_1_exactly_as_meant(default_run, name):
    """yeto with the departure = the reference with it; both far from Algorithm 1 on
    the same case otherwise (lora-nesterov-k2's reference)."""
    case = _case(f"{NESTEROV},{DEPARTURES[name]}")
    ref, yeto = _traces(default_run, name)
    _assert_same_run(ref, yeto, case, _final_file(default_run, name, case))
    algorithm_1 = rd.Trace.load(default_run / "lora-nesterov-k2", "reference")
    last = str(case.rounds)
    assert rd.theta_rel(yeto.thetas[last], algorithm_1.thetas[last]) > 100 * TOL
    if name == "token-weights":  # the weights matter only where the islands' tokens differ
        rounds = list(zip(*yeto.tokens.values()))
        assert any(len(set(r)) > 1 for r in rounds), yeto.tokens


@pytest.mark.slow
@pytest.mark.parametrize("name", BIT_FOR_BIT)
def test_with_the_syncers_rounding_yeto_is_the_reference_bit_for_bit(slow_run, name):
    """Torch's SGD and yeto's syncer take the same Nesterov step with float32 operations
    in another order; training amplifies that last-bit difference round by round
    (BENCHMARKS.md, "DiLoCo, exactly"). With the syncer's order (--yeto-rounding) the
    reference equals yeto to the bit, however long the run: with two islands nothing
    else is left to round differently (four sum their pushes in arrival order)."""
    case = _case(BIT_FOR_BIT[name])
    ref, yeto = _traces(slow_run, name)
    _assert_same_run(ref, yeto, case, _final_file(slow_run, name, case))
    assert rd.round_losses(yeto, case) == rd.round_losses(ref, case)
    for when, theta in ref.thetas.items():
        for tensor, values in theta.items():
            np.testing.assert_array_equal(yeto.thetas[when][tensor], values,
                                          err_msg=f"{when} {tensor}")


def test_compare_torchft_defaults_are_the_issues_run():
    """scripts/compare_torchft.py: two replicas, H = 20, full weights, both outer
    optimizers, as its --help says; the script starts without torchft (no dependency of
    yeto's: only its runs import it)."""
    r = subprocess.run([sys.executable, "scripts/compare_torchft.py", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, COLUMNS="200"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert importlib.util.find_spec("torchft") is None  # else the start proves nothing
    text = " ".join(r.stdout.split())
    for flag, default in (("--islands K", "2"), ("--sync-every H", "20"),
                          ("--tuning {lora,full}", "full"),
                          ("--outer {average,nesterov,both}", "both")):
        said = re.search(re.escape(flag) + r" (?:(?!--).)*?\(default: ([^)]*)\)", text)
        assert said is not None and said.group(1) == default, (flag, text)
