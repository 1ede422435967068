"""Each package's `__init__` docstring is a map of the package: it names every module
and subpackage in it.

A name counts when it appears in backticks (`name`, or dotted: `yeto.codec.format`)
or as the first word of an indented map line followed by its description
(``  name   what it does``, as in `syncer/__init__.py`), so an English word that happens
to be a module's name does not count. `yeto/proto` is generated and not checked.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP_LEVEL = ("yeto", "syncer")
SKIPPED = {Path("yeto/proto")}


def _packages() -> list[Path]:
    found = []
    for top in TOP_LEVEL:
        for init in sorted((ROOT / top).rglob("__init__.py")):
            package = init.parent.relative_to(ROOT)
            if package not in SKIPPED and "__pycache__" not in package.parts:
                found.append(package)
    return found


def _members(package: Path) -> list[str]:
    """The package's modules (but `__init__` and `__main__`) and subpackages."""
    names = []
    for entry in sorted((ROOT / package).iterdir()):
        if entry.is_file() and entry.suffix == ".py":
            if entry.stem not in ("__init__", "__main__"):
                names.append(entry.stem)
        elif entry.is_dir() and (entry / "__init__.py").is_file():
            names.append(entry.name)
    return names


def _mapped(name: str, doc: str) -> bool:
    quoted = re.compile(r"`(?:[\w.]+\.)?" + re.escape(name) + r"`")
    map_line = re.compile(r"^\s+(?:[-*]\s+)?" + re.escape(name) + r"(?: {2,}|:\s)", re.M)
    return bool(quoted.search(doc) or map_line.search(doc))


def test_packages_are_found():
    packages = _packages()
    assert Path("yeto") in packages and Path("syncer") in packages
    assert Path("yeto/island") in packages


@pytest.mark.parametrize("package", _packages(), ids=str)
def test_init_docstring_names_each_module(package: Path):
    source = (ROOT / package / "__init__.py").read_text(encoding="utf-8")
    doc = ast.get_docstring(ast.parse(source)) or ""
    missing = [name for name in _members(package) if not _mapped(name, doc)]
    assert not missing, (
        f"{package}/__init__.py's docstring does not name: {', '.join(missing)} "
        "(name each in backticks, or as the first word of an indented map line)"
    )


def test_rule_ignores_plain_words():
    doc = "The run ends when the island finishes.\n\n  merge    the running sum\n"
    assert not _mapped("run", doc)
    assert not _mapped("island", doc)
    assert _mapped("merge", doc)
    assert _mapped("format", "see `yeto.codec.format`")
    assert not _mapped("format", "see `yeto.codec.formats`")
