"""What the syncer tests in more than one tier share."""

from support import make_client

from yeto import codec
from yeto.transport import PushReply


def _join_all(address, layout, ids, init, **kw):
    clients = [make_client(address, i, layout, **kw) for i in ids]
    for c in clients:
        c.start(init)
    return clients


def _push(c, delta, tokens, base, seq, encoding="f32") -> PushReply:
    return c.push(codec.encode(delta, encoding), encoding=encoding, base_version=base,
                  loss_tokens=tokens, steps=3, seq=seq).result(timeout=20)


def _wait_version(c, version, timeout=20):
    """The first broadcast `c` receives at `version` or later (None if none comes)."""
    got = c.wait_one(timeout=timeout)
    while got is not None and got.version < version:
        got = c.wait_one(timeout=timeout)
    return got
