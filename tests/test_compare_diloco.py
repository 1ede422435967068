"""scripts/compare_diloco.py --smoke: two arms (one island; two DiLoCo islands and a
syncer, as real processes) for a few steps; the table and the RESULT lines parse.

Nothing about the losses is asserted beyond being finite: the numbers are for
BENCHMARKS.md, measured by the full script."""

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
ARM_LINE = re.compile(
    r"^RESULT arm=(?P<arm>\S+) seed=(?P<seed>\S+) eval_loss=(?P<loss>\S+) ratio=(?P<ratio>\S+) "
    r"bytes_up=(?P<up>\d+) bytes_down=(?P<down>\d+) bytes_per_token_ratio=(?P<bpt>\S+)$")
GOAL_LINE = re.compile(r"^RESULT goal=(?P<goal>\S+)(?P<kv>( \S+=\S+)*)$")


@pytest.mark.slow
def test_compare_diloco_smoke(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_diloco.py"), "--smoke",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "FAILED" not in out, out[-3000:]

    # the table: a header, a rule, one row per arm
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("arm "))
    assert set(lines[head + 1]) == {"-"}
    cols = re.split(r"\s{2,}", lines[head].strip())  # cells are 2+ spaces apart
    rows = {}
    for line in lines[head + 2:head + 4]:
        cells = re.split(r"\s{2,}", line.strip())
        assert len(cells) == len(cols), (cols, cells)
        rows[cells[0]] = dict(zip(cols, cells))
    assert set(rows) == {"single", "diloco2-H6-q4"}
    for row in rows.values():
        assert float(row["eval"]) > 0
    assert float(rows["diloco2-H6-q4"]["x fewer"]) > 1

    arms = {m["arm"]: m for m in map(ARM_LINE.match, lines) if m}
    assert set(arms) == {"lora:single", "lora:diloco2-H6-q4"}
    for m in arms.values():
        assert math.isfinite(float(m["loss"])) and float(m["loss"]) > 0
    single, dl = arms["lora:single"], arms["lora:diloco2-H6-q4"]
    assert int(single["up"]) == int(single["down"]) == 0
    # DiLoCo: q4 pushes up, f32 weights down, both counted from the syncer's tape
    assert 0 < int(dl["up"]) < int(dl["down"])
    assert 0 < float(dl["bpt"]) < 1  # fewer bytes per token than a ring all-reduce
    goals = [m for m in map(GOAL_LINE.match, lines) if m]
    assert {m["goal"] for m in goals} == {"diloco4_q4_H50", "q4_vs_f32", "full_table2"}
    for m in goals:  # every goal line says whether it was met (n/a: its arms did not run)
        kv = dict(x.split("=", 1) for x in m["kv"].split())
        assert kv["met"] in ("yes", "no", "n/a")

    # every arm's result is cached: a rerun runs nothing and prints the same lines
    again = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_diloco.py"),
                            "--smoke", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                           text=True, timeout=120, check=False)
    assert again.returncode == 0 and "running" not in again.stdout
    assert [x for x in again.stdout.splitlines() if x.startswith("RESULT")] == \
        [x for x in lines if x.startswith("RESULT")]


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
