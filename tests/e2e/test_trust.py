"""The trust boundary (issue 28): what an island holding a valid credential, a silent
peer, a full disk or an operator's slip can do to a run. One test per failure class,
each through a real gRPC syncer (in this process, or `python -m syncer` where the
process is what fails); each of them failed before the bounds existed.

Here: the checks that need real processes (the others: tests/unit/test_trust.py,
tests/integration/test_trust.py)."""


import subprocess
import sys
from pathlib import Path

from syncer import spawn

ROOT = Path(__file__).resolve().parents[2]


def test_a_second_syncer_on_a_taken_port_exits_naming_it(tmp_path):
    """Two syncers on one port both used to say "listening" and split the islands."""
    first = spawn.start_syncer(["--quorum", "1"], cwd=ROOT, log=tmp_path / "first.log")
    try:
        second = subprocess.run([sys.executable, "-m", "syncer", "--port", str(first.port)],
                                cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert second.returncode != 0
        assert str(first.port) in second.stderr and "in use" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        first.stop()


def test_a_background_thread_that_dies_ends_the_process_loudly():
    code = ("import threading\n"
            "from yeto.signals import die_with_threads\n"
            "die_with_threads()\n"
            "threading.Thread(target=lambda: 1 / 0, name='committer').start()\n"
            "threading.Event().wait()\n")  # only the dead thread can end it
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 70 and "committer died" in r.stderr
