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
