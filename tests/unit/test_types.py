"""The syncer and the backend-free core it imports type-check under `mypy --strict`.

What is checked, and how strictly, is pyproject.toml's `[tool.mypy]` (its `files`: the
syncer's package and the yeto modules it reaches that import neither torch nor mlx);
this runs the same check a developer's `mypy` (no arguments) runs, in this process
through `mypy.api` (the unit tier starts no process). Its cache lives in the
repository's `.mypy_cache` (git ignores it), so a second run only rechecks what changed.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed (pip install -e '.[dev]' installs it)")
def test_syncer_and_core_type_check_strictly(monkeypatch: pytest.MonkeyPatch) -> None:
    from mypy import api

    monkeypatch.chdir(ROOT)  # `files` in the config are relative to the repository
    out, err, status = api.run(["--config-file", os.fspath(ROOT / "pyproject.toml"),
                                "--cache-dir", os.fspath(ROOT / ".mypy_cache")])
    assert status == 0, (
        "mypy --strict (pyproject.toml [tool.mypy]) found problems; fix the annotations or "
        "the code it points at (a missing stub package: pip install -e '.[dev]'):\n"
        + (out + err).strip())
