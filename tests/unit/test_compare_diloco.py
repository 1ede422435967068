"""scripts/compare_diloco.py --smoke: two arms (one island; two DiLoCo islands and a
syncer, as real processes) for a few steps; the table and the RESULT lines parse.

Nothing about the losses is asserted beyond being finite: the numbers are for
BENCHMARKS.md, measured by the full script.

Here: the checks that need no process, server or training (the others:
tests/e2e/test_compare_diloco.py)."""


import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


sys.path.insert(0, str(ROOT / "scripts"))


def test_cross_tables_place_each_arm_by_its_flags(capsys):
    """The outer grid and the wire cross put each arm's ratio to its reference (the mean
    over seeds, ± half the range) in the cell its flags name, and nowhere else."""
    import compare_diloco as cd

    _, arms, _ = cd.plan("long")
    rows = {a.key: cd.Row(a) for a in arms if a.regime == "warm"}
    loss = {"warm:dp4": (2.0, 4.0), "warm:diloco4-H50-q4-dq4-lr04m05": (2.2, 4.2),
            "warm:diloco4-H50-q4-dq4-o04": (2.0, 4.0), "warm:diloco4-H50-q4-dq4": (1.0, 2.0),
            "warm:diloco4-H50-q4-dq4-m05": (3.0, 6.0), "warm:diloco4-H50-f32-nest": (2.0, 4.4),
            "warm:diloco4-H50-bf16-dq4-nest": (1.9, 3.6), "warm:diloco4-H50-q4-nest": (2.0, 4.0),
            "warm:diloco4-H50-q4-dq4-nest": (2.4, 4.0)}
    for key, (s0, s1) in loss.items():
        rows[key].results = {0: {"eval_loss": s0}, 1: {"eval_loss": s1}}
    cd.attach_ratios(rows)
    cd.print_grids(rows, md=True)
    cd.print_wires(rows, md=True)
    out = capsys.readouterr().out
    grid = out[out.index("outer grid, warm, k = 4"):out.index("wire, warm")]
    assert "| 0.4 | - | 1.0750 ± 0.0250 (2) | 1.0000 ± 0.0000 (2) |" in grid
    assert "| 0.7 | - | 1.5000 ± 0.0000 (2) | 1.1000 ± 0.1000 (2) |" in grid
    assert "| 1 | 0.5000 ± 0.0000 (2) | - | - |" in grid
    wire = out[out.index("wire, warm"):]
    assert "| f32 | 1.0500 ± 0.0500 (2) | - |" in wire
    assert "| bf16 | - | 0.9250 ± 0.0250 (2) |" in wire
    assert "| q4 | 1.0000 ± 0.0000 (2) | 1.1000 ± 0.1000 (2) |" in wire
    assert "k = 2" not in out and "scratch" not in out  # too few cells: no table


def test_q4_vs_f32_goal_compares_the_seeds_both_arms_ran():
    """The q4-vs-f32 gap is the ratio of mean losses over the seeds both arms ran, for
    q4 both ways and for q4 up with f32 down."""
    import compare_diloco as cd

    _, arms, _ = cd.plan("long")
    rows = {a.key: cd.Row(a) for a in arms if a.regime == "warm"}
    rows["warm:diloco4-H50-f32-nest"].results = {0: {"eval_loss": 2.0}}
    rows["warm:diloco4-H50-q4-nest"].results = {0: {"eval_loss": 2.004}, 1: {"eval_loss": 9.0}}
    rows["warm:diloco4-H50-q4-dq4-nest"].results = {0: {"eval_loss": 2.1}, 1: {"eval_loss": 2.0}}
    lines = [x for x in cd.long_goal_lines(rows) if "goal=long_q4_vs_f32" in x]
    assert lines == [
        "RESULT goal=long_q4_vs_f32 arm=warm:H50 wire=q4/q4 met=no gap=+5.00% seeds=1",
        "RESULT goal=long_q4_vs_f32 arm=warm:H50 wire=q4/f32 met=yes gap=+0.20% seeds=1"]
