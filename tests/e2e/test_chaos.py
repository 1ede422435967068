"""The chaos harness end to end: a real syncer, three numpy islands and a rogue client
through 20 seeded faults (scripts/chaos.py; its docstring lists the kinds and checks)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULT = re.compile(r"RESULT faults=(\d+) kinds=(\d+) rounds=(\d+) lost_commits=(-?\d+) "
                    r"theta_finite=(\d) islands_identical=(\d)")


def test_chaos_twenty_faults(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "chaos.py"), "--faults", "20",
                        "--seed", "1", "--workdir", str(tmp_path / "chaos")],
                       cwd=ROOT, capture_output=True, text=True, timeout=1200)
    out = r.stdout.strip().splitlines()
    tail = "\n".join(out[-40:]) + "\n" + r.stderr[-3000:]
    assert out, tail
    m = RESULT.fullmatch(out[-1])
    assert m, tail
    faults, kinds, rounds, lost, finite, identical = map(int, m.groups())
    available = re.search(r"^AVAILABLE kinds=(\d+)", r.stdout, re.MULTILINE)
    assert available, tail
    # every kind but disk-full (root only: the state dir on a tmpfs) runs anywhere
    assert int(available.group(1)) >= 8
    assert faults == 20 and kinds >= int(available.group(1)) and rounds > 20, tail
    assert lost == 0 and finite == 1 and identical == 1, tail
    assert r.returncode == 0, tail  # and every fault was handled as it must be
