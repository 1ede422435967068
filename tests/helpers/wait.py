"""Bounded waits the tests share: on a condition, and on processes run at once."""

import subprocess
import sys
import time


def wait_until(pred, timeout=20.0, interval=0.02) -> bool:
    """Poll `pred` until it holds (True) or `timeout` seconds pass (False): a bound on
    a wait for an event, never a measure of speed."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return True
        time.sleep(interval)
    return False


def run_together(*argvs, cwd=None, timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """`python ARGV` for each argv, the processes running at the same time (tests whose
    processes mostly wait need not wait one after the other)."""
    procs = [subprocess.Popen([sys.executable, *map(str, a)], cwd=cwd, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for a in argvs]
    outs = [p.communicate(timeout=timeout) for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, o, e)
            for p, (o, e) in zip(procs, outs)]
