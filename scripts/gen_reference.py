"""Write docs/reference/: every `yeto` command's flags (its --help) and every run-file
key, generated from the parsers themselves (yeto.cli.reference), so the reference cannot
drift from the code.

    python scripts/gen_reference.py              # (re)write docs/reference/
    python scripts/gen_reference.py --check      # exit 1 naming the stale files

tests/unit/test_reference.py runs the check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's yeto

from yeto.cli.reference import pages  # noqa: E402

OUT = ROOT / "docs" / "reference"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare, write nothing")
    args = p.parse_args(argv)
    want = pages()
    stale = sorted(n for n, text in want.items()
                   if not (OUT / n).is_file() or (OUT / n).read_text() != text)
    extra = sorted(f.name for f in OUT.glob("*.md") if f.name not in want) \
        if OUT.is_dir() else []
    if args.check:
        for n in stale + extra:
            print(f"stale: docs/reference/{n}", file=sys.stderr)
        if stale or extra:
            print("run: python scripts/gen_reference.py", file=sys.stderr)
        return 1 if stale or extra else 0
    OUT.mkdir(parents=True, exist_ok=True)
    for n in extra:
        (OUT / n).unlink()
    for n in stale:
        (OUT / n).write_text(want[n])
    print(f"docs/reference: {len(stale)} written, {len(extra)} removed, {len(want)} pages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
