"""What the provenance tests in more than one tier share."""

import hashlib
from pathlib import Path


def recipe_digest(root: Path, suffixes=None, only=None) -> str:
    """The documented content digest, computed here independently: SHA-256 over
    "relative path NUL size NUL sha256(file) LF" of every non-hidden file (with one
    of `suffixes`, or named in `only`), sorted by path."""
    lines = []
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if (not p.is_file() or any(part.startswith(".") for part in rel.parts)
                or (suffixes and p.suffix not in suffixes)
                or (only is not None and rel.as_posix() not in only)):
            continue
        data = p.read_bytes()
        lines.append(f"{rel.as_posix()}\0{len(data)}\0{hashlib.sha256(data).hexdigest()}\n")
    return "sha256:" + hashlib.sha256("".join(sorted(lines)).encode()).hexdigest()
