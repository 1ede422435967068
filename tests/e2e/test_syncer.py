"""The syncer over real gRPC on loopback, driven by synthetic numpy islands.

Here: the checks that need real processes (the others: tests/integration/test_syncer.py)."""


import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from helpers.syncer import join_all, push_delta, wait_version

from syncer.spawn import start_syncer
from syncer.tape import read_tape

ROOT = Path(__file__).resolve().parents[2]


BLOCKED = ("torch", "transformers", "peft", "mlx")


def test_python_m_syncer_serves_a_run_without_torch_transformers_peft_mlx(toy_layout, tmp_path):
    """`python -m syncer` with torch, transformers, peft and mlx unimportable (None in
    sys.modules from interpreter start, via sitecustomize) serves two numpy islands for
    two rounds and writes the final weights."""
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(
        f"import sys\nfor name in {BLOCKED!r}:\n    sys.modules[name] = None\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(block), str(ROOT), os.environ.get("PYTHONPATH")) if p))
    for name in BLOCKED:  # the block holds in that environment
        r = subprocess.run([sys.executable, "-c", f"import {name}"], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "halted; None in sys.modules" in r.stderr, r.stderr
    sd = tmp_path / "state"
    init = np.zeros(toy_layout.numel, np.float32)
    averaging = ["--outer", "nesterov", "--outer-lr", "1", "--outer-momentum", "0"]
    with start_syncer(["--quorum", "2", "--rounds", "2", "--state-dir", str(sd),
                       "--token", "s3cret", "--round-timeout-s", "600", *averaging], cwd=ROOT,
                      env=env,
                      log=tmp_path / "syncer.log") as syncer:
        a, b = join_all(syncer.address, toy_layout, ["a", "b"], init, token="s3cret")
        a.wait_one(timeout=60), b.wait_one(timeout=60)
        for r in range(2):
            for i, c in enumerate((a, b)):
                d = np.full(toy_layout.numel, float(i + 1), np.float32)
                assert push_delta(c, d, 10, base=r, seq=r).accepted
        finals = [wait_version(c, 2, timeout=60) for c in (a, b)]
        assert all(f.final for f in finals)
        assert syncer.wait(timeout=60) == 0, syncer.tail()
        a.close(), b.close()
    log = (tmp_path / "syncer.log").read_text()
    assert "Traceback" not in log and "run finished at version 2" in log
    merges = [r for r in read_tape(sd / "tape.jsonl") if r["event"] == "merge"]
    assert [(r["round"], r["reason"], len(r["responders"])) for r in merges] == \
        [(1, "all", 2), (2, "all", 2)]
    from safetensors.numpy import load_file

    final = toy_layout.flatten(load_file(sd / "final" / "weights.safetensors"))
    np.testing.assert_array_equal(final, init - 2 * 1.5)  # two rounds of mean(1, 2), lr 1
    assert final.tobytes() == finals[0].theta.tobytes() == finals[1].theta.tobytes()
    prov = (sd / "final" / "provenance.json").read_text()
    assert "s3cret" not in prov and json.loads(prov)["syncer"]["version"] == 2
