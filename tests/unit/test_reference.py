"""docs/reference/ is generated from the parsers (scripts/gen_reference.py): a flag or a
run-file key changed without regenerating it fails here, naming the stale pages."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference",
                                                  ROOT / "scripts" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_is_current(monkeypatch):
    gen = _generator()
    monkeypatch.setenv("COLUMNS", gen.WIDTH)
    want = gen.pages()
    have = {p.name: p.read_text() for p in (ROOT / "docs" / "reference").glob("*.md")}
    stale = sorted(n for n in want.keys() | have.keys() if want.get(n) != have.get(n))
    assert not stale, f"docs/reference is stale ({stale}): run python scripts/gen_reference.py"
    assert "--sync-every" in want["island.md"] and "| `r` | `--lora-r`" in want["run-file.md"]
