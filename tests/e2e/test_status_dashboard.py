"""`yeto status` and the syncer's dashboard, against real syncers and islands.

Here: the checks that need real processes (the others:
tests/unit/test_status_dashboard.py, tests/integration/test_status_dashboard.py)."""


import json
import shutil
import struct
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from support import make_client, running_syncer, wait_until

from syncer.dashboard import start_dashboard
from syncer.spawn import start_syncer
from yeto.client import SyncerClient
from yeto.island import FlatWeights, Island
from yeto.layout import Layout

ROOT = Path(__file__).resolve().parents[2]


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


def test_syncer_cli_serves_the_dashboard(tmp_path):
    log = tmp_path / "syncer.log"
    with start_syncer(cwd=ROOT, dashboard_port=0, log=log) as syncer:
        s = json.loads(_get(syncer.dashboard_url + "api/status")[2])
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
            _rejected_join(address)
            threads = _run_islands(address, steps=200)  # still training while we look
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
