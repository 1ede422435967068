"""Multi-host runs in the network lab (yeto.testing.netlab): every host is a network
namespace on one switch, with documentation addresses (192.0.2.0/24) that exist only
inside the lab, so nothing leaves the machine and nothing in the root namespace
takes part. The syncer listens on host a's own address (192.0.2.1), islands run on
other hosts, and the tests wait on events (port files, log lines, the tape), never
on fixed sleeps where an event exists.

Needs root and iproute2; skipped with the reason elsewhere. Also here: the deployment
recipes in examples/deploy/, checked as far as this machine can (no Slurm, no cloud).

Here: the checks that need no process, server or training (the others:
tests/e2e/test_multihost.py)."""


from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PORT = 29400


# ---- deployment recipes (examples/deploy/) ---------------------------------------------
DEPLOY = ROOT / "examples" / "deploy"


def test_skypilot_tasks_parse_and_pass_the_syncer_address_in():
    yaml = pytest.importorskip("yaml")
    syncer = yaml.safe_load((DEPLOY / "skypilot" / "syncer.yaml").read_text())
    island = yaml.safe_load((DEPLOY / "skypilot" / "island.yaml").read_text())
    assert syncer["resources"]["ports"] == PORT and "python -m syncer" in syncer["run"]
    assert "SYNCER" in island["envs"] and '--syncer "$SYNCER"' in island["run"]
    for task in (syncer, island):  # a required secret, never on a command line
        assert task["secrets"] == {"YETO_TOKEN": None} and "YETO_TOKEN" not in task["envs"]
        assert "--token" not in task["run"]


@pytest.mark.parametrize("envs, want", [
    ({}, []),
    ({"SHARD": "1/2"}, ["--shard", "1/2"]),
    ({"SHARD": "1/2", "STANDBY_OF": "10.0.0.5:29400", "SKYPILOT_NODE_IPS": "10.0.0.9\n10.0.0.10"},
     ["--shard", "1/2", "--standby-of", "10.0.0.5:29400", "--advertise", "10.0.0.9:29400"]),
])
def test_skypilot_syncer_task_serves_a_shard_or_stands_by(tmp_path, envs, want):
    """The syncer task's run script, with python replaced by echo: SHARD and STANDBY_OF
    turn into the syncer's flags (a standby advertises its first internal IP)."""
    import os
    import subprocess

    yaml = pytest.importorskip("yaml")
    task = yaml.safe_load((DEPLOY / "skypilot" / "syncer.yaml").read_text())
    script = task["run"].replace("exec python", "exec echo")
    env = dict(os.environ, HOME=str(tmp_path), QUORUM="2", SYNCER_ARGS="--fragments 8",
               **{k: str(v) for k, v in task["envs"].items() if k not in envs and k not in
                  ("QUORUM", "SYNCER_ARGS")}, **envs)
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[:2] == ["-m", "syncer"]
    tail = out[out.index(str(tmp_path / "yeto-syncer" / "state")) + 1:]
    assert tail == [*want, "--fragments", "8"]
