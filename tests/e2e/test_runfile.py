"""One run file for the whole run: `yeto launch --config examples/lora.toml`, and the
same file given to `yeto syncer` and two `yeto island` processes by hand, give the same
run, bit for bit (blocking sync and no grace window, so timing cannot reorder it)."""

import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from syncer.spawn import start_syncer

ROOT = Path(__file__).resolve().parents[2]
# the same for both runs; flags win over the file
SHORT = ["--max-steps", "20", "--sync-every", "10", "--blocking-sync", "--threads", "1"]


def _workdir(tmp_path: Path, model: Path, task) -> Path:
    """A folder laid out as the example expects: runs/demo/model, runs/demo/data."""
    demo = tmp_path / "runs" / "demo"
    (demo / "data").mkdir(parents=True)
    shutil.copytree(model, demo / "model")
    for f in task:
        shutil.copy(f, demo / "data" / Path(f).name)
    return tmp_path


def _launched(work: Path, config: Path) -> Path:
    r = subprocess.run([sys.executable, "-m", "yeto", "launch", "--config", str(config),
                        "--out", "launched", "--display", "plain", "--no-dashboard",
                        "--grace-ms", "0", *SHORT], cwd=work, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "held-out loss:" in r.stdout
    return work / "launched" / "adapter" / "adapter_model.safetensors"


def _by_hand(work: Path, config: Path) -> Path:
    state = work / "by-hand" / "syncer"
    with start_syncer(["--config", str(config), "--state-dir", str(state), "--grace-ms", "0"],
                      cwd=work) as syncer:
        islands = [subprocess.Popen(
            [sys.executable, "-m", "yeto", "island", "--config", str(config), "--syncer",
             syncer.address, "--learner-id", f"island-{i}", "--output",
             str(work / "by-hand" / f"island-{i}"), "--no-progress", *SHORT],
            cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for i in range(2)]
        for p in islands:
            _, err = p.communicate(timeout=600)
            assert p.returncode == 0, err[-3000:]
        assert syncer.proc.wait(timeout=120) == 0
    return state / "final" / "adapter_model.safetensors"


@pytest.mark.long  # minute-scale: .ci/run runs it after the default tier
def test_launch_and_by_hand_runs_of_one_run_file_are_the_same_run(tmp_path, tiny_llama,
                                                                  tiny_task):
    config = ROOT / "examples" / "lora.toml"
    work = _workdir(tmp_path, tiny_llama, tiny_task)
    with ThreadPoolExecutor(1) as pool:  # both runs at once: blocking sync orders each
        launched = pool.submit(_launched, work, config)
        b = load_file(str(_by_hand(work, config)))
        a = load_file(str(launched.result()))
    assert a.keys() == b.keys()
    assert {v.shape[0] for k, v in a.items() if "lora_A" in k} == {8}  # [lora] r = 8
    assert max(float(np.abs(v).max()) for k, v in a.items() if "lora_B" in k) > 0  # trained
    for k in a:
        assert np.array_equal(a[k], b[k]), k
