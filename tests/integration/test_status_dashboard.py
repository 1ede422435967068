"""`yeto status` and the syncer's dashboard, against real syncers and islands.

Here: the checks through in-process servers, training or the sim (the others:
tests/unit/test_status_dashboard.py, tests/e2e/test_status_dashboard.py)."""


import json
import urllib.error
import urllib.request

import pytest
from helpers.status_dashboard import EVIL, LAYOUT, http_get, rejected_join, run_islands
from helpers.syncer import running_syncer

from syncer.dashboard import DashboardError, start_dashboard
from yeto.cli import status as status_cli


# ---- yeto status ------------------------------------------------------------------------
def test_status_shows_islands_rounds_and_bytes(capsys):
    with running_syncer(quorum=2, grace_ms=20, token="s3cret") as (run, address):
        for t in run_islands(address, token="s3cret"):
            t.join(timeout=60)
        assert status_cli.main([address, "--json", "--token", "s3cret"]) == 0
        s = json.loads(capsys.readouterr().out)
        assert s["version"] == run.version >= 6 and s["finished"] is True
        assert s["bytes_in"] > 0 and s["bytes_out"] > 0 and s["last_merge_s"] >= 0
        assert sorted(i["learner_id"] for i in s["islands"]) == ["island-0", "island-1"]
        assert {i["state"] for i in s["islands"]} == {"finished"}
        assert all(i["pushes"] == 6 and i["loss_tokens"] > 0 for i in s["islands"])
        assert isinstance(s["islands"][0]["loss_tokens"], int)  # not protobuf's strings
        assert status_cli.main([address, "--token", "s3cret"]) == 0
        text = capsys.readouterr().out
        assert f"syncer {address}" in text and "finished" in text
        assert "island-0  numpy    finished" in text and "loss tokens" in text
        # no token: a clear error, exit 1
        assert status_cli.main([address]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err


# ---- the dashboard's API ----------------------------------------------------------------
def test_dashboard_api(tmp_path):
    with running_syncer(quorum=2, grace_ms=20, state_dir=tmp_path / "state") as (run, address):
        dash = start_dashboard(run, "127.0.0.1", 0)
        try:
            rejected_join(address)
            for t in run_islands(address):
                t.join(timeout=60)
            code, ctype, body = http_get(dash.url)
            assert code == 200 and ctype.startswith("text/html")
            page = body.decode()
            assert "<script" in page and "http://" not in page.replace("http://HOST", "")
            _, ctype, body = http_get(dash.url + "api/status")
            s = json.loads(body)
            assert ctype == "application/json" and s["version"] == run.version
            assert s["rejected"] == 1 and s["config"]["quorum"] == 2
            assert s["parameters"] == LAYOUT.numel
            assert sorted(i["learner_id"] for i in s["islands"]) == ["island-0", "island-1"]
            tape = json.loads(http_get(dash.url + "api/tape")[2])
            merges = [r for r in tape["records"] if r["event"] == "merge"]
            assert len(merges) == run.version and tape["next"] == len(tape["records"])
            assert all(x["eval_loss"] is not None for r in merges for x in r["responders"])
            assert [r["learner"] for r in tape["records"] if r["event"] == "rejected"] == [EVIL]
            later = json.loads(http_get(dash.url + f"api/tape?since={tape['next'] - 1}")[2])
            assert len(later["records"]) == 1 and later["next"] == tape["next"]
            assert http_get(dash.url + "healthz")[2] == b"ok\n"
            with pytest.raises(urllib.error.HTTPError) as e:
                http_get(dash.url + "nope")
            assert e.value.code == 404
            with pytest.raises(urllib.error.HTTPError) as e:
                http_get(dash.url + "api/tape?since=x")
            assert e.value.code == 400
        finally:
            dash.stop()


def test_dashboard_beyond_loopback_needs_the_token():
    with running_syncer(quorum=1) as (run, _):
        with pytest.raises(DashboardError, match="without a token"):
            start_dashboard(run, "0.0.0.0", 0)
        dash = start_dashboard(run, "0.0.0.0", 0, token="tok")
        try:
            base = f"http://127.0.0.1:{dash.port}/"
            for path in ("", "api/status", "api/tape"):
                with pytest.raises(urllib.error.HTTPError) as e:
                    http_get(base + path)
                assert e.value.code == 401
                with pytest.raises(urllib.error.HTTPError):
                    http_get(base + path, {"Authorization": "Bearer wrong"})
            assert http_get(base + "api/status", {"Authorization": "Bearer tok"})[0] == 200
            assert http_get(base + "?token=tok")[0] == 200  # what a browser opens
            assert http_get(base + "api/tape?since=0&token=tok")[0] == 200
        finally:
            dash.stop()


def test_a_loopback_dashboard_checks_host_and_the_run_s_token():
    """On loopback the dashboard asked no token even when the run had one, and answered
    any Host header: a page whose name was rebound to 127.0.0.1 could read the islands,
    losses and state dir (issue 44)."""
    with running_syncer(quorum=1) as (run, _):
        dash = start_dashboard(run, "127.0.0.1", 0, token="tok")
        try:
            base = f"http://127.0.0.1:{dash.port}/"
            with pytest.raises(urllib.error.HTTPError) as e:
                http_get(base + "api/status")
            assert e.value.code == 401
            assert http_get(base + "api/status", {"Authorization": "Bearer tok"})[0] == 200
            for host in (f"evil.example:{dash.port}", "evil.example", "127.0.0.1.evil.example"):
                with pytest.raises(urllib.error.HTTPError) as e:
                    http_get(base + "api/status", {"Authorization": "Bearer tok", "Host": host})
                assert e.value.code == 421, host
            for host in (f"localhost:{dash.port}", f"[::1]:{dash.port}", "127.0.0.1"):
                assert http_get(base + "api/status",
                            {"Authorization": "Bearer tok", "Host": host})[0] == 200, host
        finally:
            dash.stop()


def test_the_dashboard_shows_the_config_but_not_its_secrets():
    """/api/status echoed the whole config, the run's token with it (and, once syncers
    dialled each other over TLS, the private key of the certificate). Now the fields a
    config keeps out of its repr stay out of the page."""
    from yeto.client.connection import TLSConfig

    with running_syncer(quorum=1, secret="run-secret-value") as (run, _):
        run.cfg.peer_tls = TLSConfig(ca=b"ca-pem", cert=b"cert-pem", key=b"private-key-pem")
        dash = start_dashboard(run, "127.0.0.1", 0, token="run-secret-value")
        try:
            body = http_get(dash.url + "api/status",
                            {"Authorization": "Bearer run-secret-value"})[2].decode()
        finally:
            dash.stop()
    s = json.loads(body)
    assert s["config"]["quorum"] == 1 and "bounds" in s["config"]
    assert "token" not in s["config"] and "peer_tls" not in s["config"]
    assert "run-secret-value" not in body and "private-key-pem" not in body
