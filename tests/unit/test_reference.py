"""docs/reference/ is generated from the parsers (yeto.cli.reference, written by
scripts/gen_reference.py): a flag or a run-file key changed without regenerating it fails
here, naming the stale pages."""

from pathlib import Path

from yeto.cli.reference import WIDTH, pages

ROOT = Path(__file__).resolve().parents[2]


def test_the_reference_is_current(monkeypatch):
    monkeypatch.setenv("COLUMNS", WIDTH)
    want = pages()
    have = {p.name: p.read_text() for p in (ROOT / "docs" / "reference").glob("*.md")}
    stale = sorted(n for n in want.keys() | have.keys() if want.get(n) != have.get(n))
    assert not stale, f"docs/reference is stale ({stale}): run python scripts/gen_reference.py"
    assert "--sync-every" in want["island.md"] and "| `r` | `--lora-r`" in want["run-file.md"]
