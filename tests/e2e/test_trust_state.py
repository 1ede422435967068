"""The state on disk under the run's secret (issue 44, trust round two): a peer who can
write the state dir but holds no secret cannot make a state that `python -m syncer
--resume` takes. Through real `python -m syncer` processes (the secret reaches the
state's digest from $YETO_TOKEN there).

The in-process checks of the state file: tests/integration/test_trust_state.py."""


import json
import os
import subprocess
from pathlib import Path

import numpy as np
from helpers.syncer import make_client, push_delta, wait_version

from syncer import spawn, state
from yeto import net

ROOT = Path(__file__).resolve().parents[2]
SECRET = "run-secret"


def _resume(state_dir: Path, env: dict) -> subprocess.CompletedProcess:
    """`python -m syncer --resume` as far as it gets without islands: it refuses the
    state and exits, or listens (then it is stopped here)."""
    try:
        with spawn.start_syncer(["--quorum", "1", "--state-dir", str(state_dir), "--resume"],
                                cwd=ROOT, env=env):
            return subprocess.CompletedProcess([], 0, "", "listened")
    except spawn.SyncerStartError as e:
        return subprocess.CompletedProcess([], 1, "", str(e))


def _forged(path: Path, kind: str) -> None:
    """What someone who can write the state dir but has no secret can do: change the
    version and recompute every digest anyone can compute (the plain SHA-256)."""
    tensors, metadata = state.read_safetensors(path)
    meta = json.loads(metadata["yeto_state"])
    meta["version"] = meta["round"] = 7
    meta[state.DIGEST_KIND] = kind
    meta[state.META_DIGEST] = state.meta_digest(meta)
    with open(path, "wb") as f:
        state.write_safetensors(f, tensors, {"yeto_state": json.dumps(meta, sort_keys=True)})


def test_a_state_forged_without_the_secret_is_refused_on_resume(tmp_path, toy_layout):
    """The state's digest was a plain SHA-256: anyone who could write the state dir could
    change the version (or Θ, or the ledger), recompute it, and the run resumed from it.
    Now it is an HMAC under the run's secret: the forgery is refused, the honest state
    resumes, and a run without the secret is told to pass it."""
    env = dict(os.environ, **{net.TOKEN_ENV: SECRET})
    state_dir = tmp_path / "s"
    with spawn.start_syncer(["--quorum", "1", "--state-dir", str(state_dir)], cwd=ROOT,
                            env=env) as syncer:
        c = make_client(syncer.address, "a", toy_layout,
                        token=net.island_credential(SECRET, "a"))
        c.start(np.zeros(toy_layout.numel, np.float32))
        assert wait_version(c, 0, timeout=60) is not None, c.last_error
        push_delta(c, np.full(toy_layout.numel, 0.1, np.float32), 3, 0, 0)
        assert wait_version(c, 1, timeout=60) is not None, c.last_error
        c.close()
    path = state_dir / state.STATE_FILE
    honest = path.read_bytes()
    for kind in (state.KEYED, state.PLAIN):
        _forged(path, kind)
        r = _resume(state_dir, env)
        assert r.returncode != 0, kind
        assert str(path) in r.stderr and "secret" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr, r.stderr
    path.write_bytes(honest)
    assert _resume(state_dir, env).stderr == "listened"
    assert (state.load(state_dir, state.StateKey(SECRET))[3]["version"]) == 1
    without = {k: v for k, v in os.environ.items() if k != net.TOKEN_ENV}
    r = _resume(state_dir, without)
    assert r.returncode != 0 and "--token" in r.stderr and "Traceback" not in r.stderr
