"""Helpers the tests share: a real syncer in this process, a client with short
backoffs, and a bounded wait on a condition."""

import contextlib
import subprocess
import sys
import time

from syncer.run import Config, Run
from syncer.service import SPILL_MIN_BYTES, serve
from yeto.client import SyncerClient

# plain averaging (outer lr 1, momentum 0): the rule a test's hand computation assumes
# where it is not the one under test (the default warms up to momentum: syncer.run.Config)
AVERAGING = dict(outer="nesterov", outer_lr=1.0, outer_momentum=0.0)


@contextlib.contextmanager
def running_syncer(token=None, spill_min_bytes=SPILL_MIN_BYTES, secret=None, **cfg):
    """A real gRPC syncer on a free loopback port, in this process. `token`: what
    callers must present; `secret`: what keys its state (`Config.token`)."""
    run = Run(Config(token=secret, **cfg))
    server, port = serve(run, "127.0.0.1", 0, token=token, spill_min_bytes=spill_min_bytes)
    try:
        yield run, f"127.0.0.1:{port}"
    finally:
        server.ticker_stop.set()
        server.stop(grace=0).wait()
        run.tape.close()


def make_client(address, learner_id, layout, **kw) -> SyncerClient:
    return SyncerClient(address, learner_id, layout, backoff_s=0.05, max_backoff_s=0.2, **kw)


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
