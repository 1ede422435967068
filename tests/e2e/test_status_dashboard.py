"""`yeto status` and the syncer's dashboard, against real syncers and islands.

Here: the checks that need real processes (the others:
tests/unit/test_status_dashboard.py, tests/integration/test_status_dashboard.py)."""


import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.status_dashboard import http_get, rejected_join, run_islands
from helpers.syncer import running_syncer
from helpers.wait import wait_until

from syncer.dashboard import start_dashboard
from syncer.spawn import start_syncer

ROOT = Path(__file__).resolve().parents[2]


def test_syncer_cli_serves_the_dashboard(tmp_path):
    log = tmp_path / "syncer.log"
    with start_syncer(cwd=ROOT, dashboard_port=0, log=log) as syncer:
        s = json.loads(http_get(syncer.dashboard_url + "api/status")[2])
        assert s["live"] and s["islands"] == [] and not s["started"]
        assert syncer.stop() == 0  # SIGTERM: a clean stop
    assert "dashboard on http://127.0.0.1:" in log.read_text()
    # beyond loopback without a token: refused before anything listens
    r = subprocess.run([sys.executable, "-m", "syncer", "--port", "0", "--dashboard-host",
                        "0.0.0.0", "--dashboard-port", "0"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "refusing to serve the dashboard on 0.0.0.0" in r.stderr


# ---- in a real browser ------------------------------------------------------------------
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _chromium(tmp_path, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1200,900",
         "--virtual-time-budget=5000", *args], capture_output=True, text=True, timeout=120)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install "
                                             "chromium); the dashboard browser test skips")
def test_dashboard_in_headless_chromium(tmp_path):
    """The page renders offline in a real browser against a live run: islands table,
    charts as inline SVG, the rejected message shown as text (never as markup)."""
    with running_syncer(quorum=2, grace_ms=20, state_dir=tmp_path / "state") as (run, address):
        dash = start_dashboard(run, "127.0.0.1", 0)
        try:
            rejected_join(address)
            threads = run_islands(address, steps=200)  # still training while we look
            assert wait_until(lambda: run.version >= 3, timeout=60)
            png = tmp_path / "dashboard.png"
            r = _chromium(tmp_path, f"--screenshot={png}", dash.url)
            assert png.exists(), r.stderr[-2000:]
            dom = _chromium(tmp_path, "--dump-dom", dash.url).stdout
            for t in threads:
                t.join(timeout=120)
        finally:
            dash.stop()
    assert _png_size(png) == (1200, 900) and png.stat().st_size > 20_000  # not a blank page
    assert 'id="islands"><table>' in dom
    for island in ("island-0", "island-1"):
        assert f"{island}</td>" in dom
    assert dom.count("<svg viewBox=\"0 0 560 220\"") == 6 and "<path d=\"M" in dom  # 6 charts
    assert "Held-out loss per island" in dom and "numpy" in dom
    assert "&lt;img src=x onerror=alert(1)&gt;" in dom and "<img" not in dom
    print(f"dashboard screenshot: {png}")
    out = ROOT / "runs" / "screenshots"
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(png, out / "dashboard.png")
