"""What the syncer tests in more than one tier share: a real syncer in this process, a
client with short backoffs, and its joins, pushes and waits for a version."""

import contextlib

from syncer.run import Config, Run
from syncer.service import SPILL_MIN_BYTES, serve
from yeto import codec
from yeto.client import SyncerClient
from yeto.transport import PushReply

# plain averaging (outer lr 1, momentum 0): the rule a test's hand computation assumes
# where it is not the one under test (the default warms up to momentum: syncer.run.Config)
AVERAGING = dict(outer="nesterov", outer_lr=1.0, outer_momentum=0.0)


@contextlib.contextmanager
def running_syncer(token=None, spill_min_bytes=SPILL_MIN_BYTES, secret=None, clock=None,
                   direct_port=0, **cfg):
    """A real gRPC syncer on a free loopback port, in this process. `token`: what
    callers must present; `secret`: what keys its state (`Config.token`); `clock`: the
    run's clock (default: time.monotonic); `direct_port`: its direct downlink's (None:
    broadcasts over gRPC only)."""
    run = Run(Config(token=secret, **cfg), **({} if clock is None else dict(clock=clock)))
    server, port = serve(run, "127.0.0.1", 0, token=token, spill_min_bytes=spill_min_bytes,
                         direct_port=direct_port)
    try:
        yield run, f"127.0.0.1:{port}"
    finally:
        server.ticker_stop.set()
        server.stop(grace=0).wait()
        run.tape.close()


def make_client(address, learner_id, layout, **kw) -> SyncerClient:
    return SyncerClient(address, learner_id, layout, backoff_s=0.05, max_backoff_s=0.2, **kw)


def join_all(address, layout, ids, init, **kw):
    clients = [make_client(address, i, layout, **kw) for i in ids]
    for c in clients:
        c.start(init)
    return clients


def push_delta(c, delta, tokens, base, seq, encoding="f32") -> PushReply:
    return c.push(codec.encode(delta, encoding), encoding=encoding, base_version=base,
                  loss_tokens=tokens, steps=3, seq=seq).result(timeout=20)


def wait_version(c, version, timeout=20):
    """The first broadcast `c` receives at `version` or later (None if none comes)."""
    got = c.wait_one(timeout=timeout)
    while got is not None and got.version < version:
        got = c.wait_one(timeout=timeout)
    return got
