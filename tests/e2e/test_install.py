"""Installs by role: `pip install yeto` (no extras) is a working syncer without torch.

A fresh virtual environment gets `pip install .` and nothing else; then
`python -m syncer --help` works, torch / transformers / peft / mlx are absent, and a
syncer with two numpy islands (`python -m yeto.testing.synthetic`, through the real
Island and gRPC client) runs to the end over the core alone.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from syncer.spawn import start_syncer

ROOT = Path(__file__).resolve().parents[2]


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory) -> Path:
    """A venv holding `pip install <repo>` with no extras (a copy of the source, so
    the build does not write into the checkout)."""
    base = tmp_path_factory.mktemp("core")
    src = base / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".venv", ".git", "runs", "*.egg-info", "__pycache__", "build", ".pytest_cache"))
    venv.create(base / "venv", with_pip=True)
    py = base / "venv" / "bin" / "python"
    r = _run([str(py), "-m", "pip", "install", "-q", str(src)])
    assert r.returncode == 0, r.stderr[-3000:]
    return py


def test_core_install_has_no_backend(core_venv):
    r = _run([str(core_venv), "-c", (
        "import importlib.util as u, json; "
        "print(json.dumps({m: u.find_spec(m) is not None for m in "
        "('torch', 'transformers', 'peft', 'mlx', 'datasets', 'grpc', 'numpy', 'rich')}))")],
        cwd="/")
    found = json.loads(r.stdout)
    assert found == {"torch": False, "transformers": False, "peft": False, "mlx": False,
                     "datasets": False, "grpc": True, "numpy": True, "rich": True}, found
    r = _run([str(core_venv), "-m", "syncer", "--help"], cwd="/")
    assert r.returncode == 0, r.stderr
    assert "--quorum" in r.stdout


def test_core_install_runs_a_two_island_run(core_venv, tmp_path):
    state = tmp_path / "state"  # cwd tmp_path: the islands import the installed yeto
    with start_syncer(["--quorum", "2", "--state-dir", str(state), "--grace-ms", "0"],
                      cwd=tmp_path, python=str(core_venv)) as syncer:
        islands = [subprocess.Popen(
            [str(core_venv), "-m", "yeto.testing.synthetic", "--syncer", syncer.address,
             "--learner-id", f"sim-{i}", "--steps", "40", "--sync-every", "10", "--dim", "256",
             "--seed", str(i), "--record", str(tmp_path / f"sim-{i}.jsonl")],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(2)]
        for p in islands:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
    done = [json.loads(line) for i in range(2)
            for line in (tmp_path / f"sim-{i}.jsonl").read_text().splitlines()
            if json.loads(line)["event"] == "done"]
    assert [d["final"] for d in done] == [True, True]
    assert done[0]["weights_sha256"] == done[1]["weights_sha256"]  # both hold the final Θ
    assert done[0]["version"] >= 4
    assert (state / "final" / "weights.safetensors").exists()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
