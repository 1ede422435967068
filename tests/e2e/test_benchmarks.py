"""The benchmark scripts run (quick mode) and end with a parseable RESULT line.

Speed is never asserted here: the ratios are printed for people to read.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULT = re.compile(r"^RESULT ratio=(\S+)((?: [A-Za-z_][A-Za-z0-9_]*=\S+)*)$")


@pytest.mark.parametrize("script", ["bench_codec.py",  # the slower two: .ci/run's long tier
                                    *(pytest.param(s, marks=pytest.mark.long)
                                      for s in ("bench_transfer.py", "bench_merge.py"))])
def test_benchmark_runs_and_reports(script):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--quick"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    m = RESULT.match(last)
    assert m, f"last line is not a RESULT line: {last!r}"
    float(m.group(1))  # the ratio is a number
    keys = [kv.split("=", 1)[0] for kv in m.group(2).split()]
    assert len(keys) == len(set(keys))


def test_benchmarks_explain_themselves():
    for script in ("bench_codec.py", "bench_transfer.py", "bench_merge.py"):
        out = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--help"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60,
                             check=False)
        assert out.returncode == 0 and "ratio" in out.stdout and "Goal" in out.stdout


@pytest.mark.long  # two real fleets, ~10 s each: .ci/run's second run
@pytest.mark.parametrize("args, key", [
    (["--quick", "--islands", "1", "--momentum", "none"], "syncer_bytes_per_param"),
    (["--half-billion", "--params", "2e6", "--rounds", "2", "--shards", "2"],
     "shard_syncer_over_stack_max"),
])
def test_memory_benchmark_runs_and_reports(args, key):
    """bench_memory's two jobs (small): the last line is a RESULT line with numbers."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_memory.py"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    fields = dict(kv.split("=", 1) for kv in last.split()[1:])
    assert last.startswith("RESULT ") and float(fields[key]) > 0, last


@pytest.mark.slow
@pytest.mark.real
def test_real_model_benchmark_runs_and_reports(tmp_path):
    """bench_real.py --quick (about 2 minutes): SmolLM2 federated against a bare peft loop;
    the last line is a RESULT line with three held-out losses and both tokens/s."""
    from yeto.testing.real import FETCH, SMOLLM2

    if SMOLLM2.available() is None:
        pytest.skip(f"SmolLM2 is not fetched: run {FETCH}")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_real.py"), "--quick",
                           "--out", str(tmp_path / "out")],
                          cwd=ROOT, capture_output=True, text=True, timeout=540, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    m = RESULT.match(last)
    assert m, f"last line is not a RESULT line: {last!r}"
    fields = dict(kv.split("=", 1) for kv in m.group(2).split())
    assert float(m.group(1)) > 0 and int(fields["rounds"]) >= 3, last
    for key in ("base", "yeto", "baseline", "island_tok_s", "bare_tok_s"):
        assert float(fields[key]) > 0, last
