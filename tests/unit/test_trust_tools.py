"""The trust boundary of the tools: a state dir the syncer creates is private.

Here: the check that needs no process (the others, which run the CLIs as a user does:
tests/e2e/test_trust_tools.py)."""

import stat


def test_a_new_state_dir_is_private(tmp_path):
    from syncer.__main__ import _check_state_dir

    state = tmp_path / "runs" / "syncer"
    _check_state_dir(state)
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert list(state.iterdir()) == []  # the probe file is gone
