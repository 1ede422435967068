"""`yeto status` and the syncer's dashboard, against real syncers and islands.

Here: the checks through in-process servers, training or the sim (the others:
tests/unit/test_status_dashboard.py, tests/e2e/test_status_dashboard.py)."""


import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
from support import make_client, running_syncer, wait_until

from syncer.dashboard import DashboardError, start_dashboard
from yeto.cli import status as status_cli
from yeto.client import SyncerClient
from yeto.island import FlatWeights, Island
from yeto.layout import Layout

LAYOUT = Layout.from_shapes({
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (4, 32),
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": (32, 4)})


EVIL = "<img src=x onerror=alert(1)>"


def _island(address, i, steps=30, token=None):
    """A numpy island pulled toward its own target (islands disagree, losses fall)."""
    rng = np.random.default_rng(i)
    target = rng.standard_normal(LAYOUT.numel).astype(np.float32)
    w = {"v": np.zeros(LAYOUT.numel, np.float32)}

    def set_w(x):
        w["v"] = x.astype(np.float32, copy=True)

    island = Island(FlatWeights(LAYOUT, lambda: w["v"].copy(), set_w),
                    client=make_client(address, f"island-{i}", LAYOUT, token=token),
                    sync_every=5, on_sync=lambda: float(np.mean((w["v"] - target) ** 2)) + i)
    island.start()
    for _ in range(steps):
        w["v"] -= 0.1 * (w["v"] - target)
        if island.after_step(100 * (i + 1), train_loss=float(np.mean((w["v"] - target) ** 2))):
            break
    island.finish()


def _run_islands(address, n=2, steps=30, token=None):
    threads = [threading.Thread(target=_island, args=(address, i, steps, token)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def _rejected_join(address):
    """A join the syncer refuses, with markup in the learner id (taped as sent)."""
    c = SyncerClient(address, EVIL, Layout.from_shapes({"x.lora_A.weight": (3,)}), backoff_s=0.05)
    c.start(np.zeros(3, np.float32))
    wait_until(lambda: c.fatal is not None, timeout=10)
    c.close()


def _get(url, headers=None):
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, r.headers.get("Content-Type"), r.read()


# ---- yeto status ------------------------------------------------------------------------
def test_status_shows_islands_rounds_and_bytes(capsys):
    with running_syncer(quorum=2, grace_ms=20, token="s3cret") as (run, address):
        for t in _run_islands(address, token="s3cret"):
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
            _rejected_join(address)
            for t in _run_islands(address):
                t.join(timeout=60)
            code, ctype, body = _get(dash.url)
            assert code == 200 and ctype.startswith("text/html")
            page = body.decode()
            assert "<script" in page and "http://" not in page.replace("http://HOST", "")
            _, ctype, body = _get(dash.url + "api/status")
            s = json.loads(body)
            assert ctype == "application/json" and s["version"] == run.version
            assert s["rejected"] == 1 and s["config"]["quorum"] == 2
            assert s["parameters"] == LAYOUT.numel
            assert sorted(i["learner_id"] for i in s["islands"]) == ["island-0", "island-1"]
            tape = json.loads(_get(dash.url + "api/tape")[2])
            merges = [r for r in tape["records"] if r["event"] == "merge"]
            assert len(merges) == run.version and tape["next"] == len(tape["records"])
            assert all(x["eval_loss"] is not None for r in merges for x in r["responders"])
            assert [r["learner"] for r in tape["records"] if r["event"] == "rejected"] == [EVIL]
            later = json.loads(_get(dash.url + f"api/tape?since={tape['next'] - 1}")[2])
            assert len(later["records"]) == 1 and later["next"] == tape["next"]
            assert _get(dash.url + "healthz")[2] == b"ok\n"
            with pytest.raises(urllib.error.HTTPError) as e:
                _get(dash.url + "nope")
            assert e.value.code == 404
            with pytest.raises(urllib.error.HTTPError) as e:
                _get(dash.url + "api/tape?since=x")
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
                    _get(base + path)
                assert e.value.code == 401
                with pytest.raises(urllib.error.HTTPError):
                    _get(base + path, {"Authorization": "Bearer wrong"})
            assert _get(base + "api/status", {"Authorization": "Bearer tok"})[0] == 200
            assert _get(base + "?token=tok")[0] == 200  # what a browser opens
            assert _get(base + "api/tape?since=0&token=tok")[0] == 200
        finally:
            dash.stop()
