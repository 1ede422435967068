"""The state file as an attacker who can write the state dir shapes it (issue 44, trust
round two): a header that asks for a huge allocation, a digest without a key. States
saved by a real in-process syncer, then resumed as `--resume` does (`Run` with
`resume=True`).

The same through `python -m syncer` and $YETO_TOKEN: tests/e2e/test_trust_state.py."""


import json
import struct

import numpy as np
import pytest
from helpers.syncer import make_client, push_delta, running_syncer, wait_version

from syncer import state
from syncer.run import Config, Run

SECRET = "run-secret"


def _saved_state(state_dir, layout, secret=None):
    """A state saved by a real syncer after one committed round (keyed with `secret`)."""
    # the secret keys the state as `python -m syncer` does from --token / $YETO_TOKEN
    with running_syncer(quorum=1, state_dir=state_dir, secret=secret) as (run, addr):
        c = make_client(addr, "a", layout)
        c.start(np.zeros(layout.numel, np.float32))
        assert wait_version(c, 0) is not None, c.last_error
        push_delta(c, np.full(layout.numel, 0.1, np.float32), 3, 0, 0)
        assert wait_version(c, 1) is not None, c.last_error
        c.close()
    return state_dir / state.STATE_FILE


def _resume(state_dir, secret=None) -> int:
    """The version `--resume` continues from (or its StateError)."""
    cfg = Config(quorum=1, state_dir=state_dir, resume=True)
    cfg.token = secret
    run = Run(cfg)
    run.tape.close()
    return run.version


def _rewrite_header(path, change) -> None:
    """`change(header)` on the file's safetensors header; the bytes after it kept."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])


@pytest.mark.parametrize("field, value, named", [
    ("shape", [2**40], "shape"),                  # 4 TiB of float32
    ("shape", [2**32, 2**32, 4], "shape"),        # wraps to 0 in int64
    ("shape", [-1], "shape"),
    ("shape", "big", "shape"),
    ("dtype", "F128", "dtype"),
    ("data_offsets", [0, 2**62], "data_offsets"),
])
def test_a_state_header_is_checked_against_the_file_before_allocating(
        tmp_path, toy_layout, field, value, named):
    """A header entry with a shape of 2^40 made `--resume` allocate 4 TiB before it
    compared the shape with the bytes the file holds. Now each entry is checked against
    the file's size first, and the refusal names the file, the tensor and the field."""
    path = _saved_state(tmp_path / "s", toy_layout)
    _rewrite_header(path, lambda h: h["theta"].__setitem__(field, value))
    with pytest.raises(state.StateError) as e:
        _resume(tmp_path / "s")
    msg = str(e.value)
    assert str(path) in msg and "theta" in msg and named in msg, msg
    if value == [2**40]:
        assert f"needs {2**42} bytes" in msg, msg


def test_a_state_header_nested_too_deep_is_refused(tmp_path, toy_layout):
    """A header of 200,000 nested JSON arrays raised RecursionError out of `--resume`
    (a traceback, not the state's error)."""
    path = _saved_state(tmp_path / "s", toy_layout)
    text = b"[" * 200_000 + b"]" * 200_000
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    with pytest.raises(state.StateError, match="corrupt") as e:
        _resume(tmp_path / "s")
    assert str(path) in str(e.value)


def test_the_state_digest_is_keyed_by_the_run_s_secret(tmp_path, toy_layout):
    """The metadata digest was a plain SHA-256 that anyone who could write the state dir
    could recompute. Now a run with a secret signs it (HMAC-SHA256): a forged state, a
    state of another secret and an unkeyed state are refused; the honest one resumes."""
    path = _saved_state(tmp_path / "s", toy_layout, secret=SECRET)
    honest = path.read_bytes()
    tensors, metadata = state.read_safetensors(path)
    meta = json.loads(metadata["yeto_state"])
    assert meta[state.DIGEST_KIND] == state.KEYED
    assert meta[state.META_DIGEST] != state.meta_digest(meta)  # not the plain SHA-256
    assert _resume(tmp_path / "s", SECRET) == 1
    for kind in (state.KEYED, state.PLAIN):  # forged: the version moved, digest recomputed
        forged = dict(meta, version=5, round=5, **{state.DIGEST_KIND: kind})
        forged[state.META_DIGEST] = state.meta_digest(forged)
        with open(path, "wb") as f:
            state.write_safetensors(f, tensors, {"yeto_state": json.dumps(forged)})
        with pytest.raises(state.StateError, match="secret"):
            _resume(tmp_path / "s", SECRET)
    path.write_bytes(honest)
    with pytest.raises(state.StateError, match="another secret"):
        _resume(tmp_path / "s", "another-secret")
    with pytest.raises(state.StateError, match="--token"):
        _resume(tmp_path / "s")  # a run without the secret cannot check it


def test_unkeyed_states_still_resume_in_a_run_without_a_secret(tmp_path, toy_layout):
    """States saved before keyed digests (format 2: a plain SHA-256) and by runs without a
    secret resume as before when the run has none; a run with a secret refuses them."""
    path = _saved_state(tmp_path / "s", toy_layout)
    tensors, metadata = state.read_safetensors(path)
    meta = json.loads(metadata["yeto_state"])
    assert meta[state.DIGEST_KIND] == state.PLAIN
    assert _resume(tmp_path / "s") == 1
    old = {k: v for k, v in meta.items() if k != state.DIGEST_KIND}
    old["format"] = 2
    old[state.META_DIGEST] = state.meta_digest(old)
    with open(path, "wb") as f:
        state.write_safetensors(f, tensors, {"yeto_state": json.dumps(old)})
    assert _resume(tmp_path / "s") == 1
    with pytest.raises(state.StateError, match="no digest under the run's secret"):
        _resume(tmp_path / "s", SECRET)
