"""scripts/compare_diloco.py --smoke: two arms (one island; two DiLoCo islands and a
syncer, as real processes) for a few steps; the table and the RESULT lines parse.

Nothing about the losses is asserted beyond being finite: the numbers are for
BENCHMARKS.md, measured by the full script.

Here: the checks that need real processes (the others: tests/unit/test_compare_diloco.py)."""


import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


ARM_LINE = re.compile(
    r"^RESULT arm=(?P<arm>\S+) seed=(?P<seed>\S+) eval_loss=(?P<loss>\S+) ratio=(?P<ratio>\S+) "
    r"bytes_up=(?P<up>\d+) bytes_down=(?P<down>\d+) bytes_per_token_ratio=(?P<bpt>\S+)$")


GOAL_LINE = re.compile(r"^RESULT goal=(?P<goal>\S+)(?P<kv>( \S+=\S+)*)$")


@pytest.mark.slow
@pytest.mark.regimes
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
