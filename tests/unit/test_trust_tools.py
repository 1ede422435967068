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


def test_the_run_s_secret_never_reaches_the_final_provenance():
    """The run's Config holds its token (it keys the state's digest); provenance.json
    is built from the Config and must not carry it."""
    import json

    from syncer import state
    from syncer.run import Config
    from yeto.client.connection import TLSConfig

    record = state.final_provenance(Config(token="s3cret-token-value", peer_tls=TLSConfig(
        ca=b"ca-pem", cert=b"cert-pem", key=b"private-key-pem")), {})
    text = json.dumps(record, default=str)
    assert "s3cret-token-value" not in text
    assert "private-key-pem" not in text  # the key a TLS syncer dials its standby with
    assert record["config"]["quorum"] == 1  # the rest of the config is there
