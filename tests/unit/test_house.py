"""The house rules the layout promises: a backend-free core, short functions and
classes, --help without measured figures, a library that never imports its CLI.

Here: the checks that need no process, server or training (the others:
tests/e2e/test_house.py)."""


from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def test_no_function_is_longer_than_60_lines():
    long = []
    for folder in ("yeto", "syncer"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "proto" in path.parts:
                continue  # generated
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > 60 and node.name != "build_parser":  # argparse builders aside
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n})")
    assert not long, long


# ---- classes and ownership -------------------------------------------------------------
# A guard against a class that does several jobs, not a target: a cohesive class that owns
# its state whole beats a short one whose methods moved into functions over its fields.
MAX_CLASS_LINES = 600


def _long_classes() -> dict[str, int]:
    long = {}
    for folder in ("yeto", "syncer"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "proto" in path.parts:
                continue  # generated
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    n = node.end_lineno - node.lineno + 1
                    if n > MAX_CLASS_LINES:
                        long[f"{path.relative_to(ROOT).as_posix()}::{node.name}"] = n
    return long


def test_no_class_is_longer_than_600_lines():
    long = _long_classes()
    assert not long, f"classes over {MAX_CLASS_LINES} lines: {long}"


def _assigned(node: ast.AST) -> list[ast.expr]:
    """The targets an assignment statement writes, tuples unpacked."""
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    else:
        return []
    out: list[ast.expr] = []
    while found:
        t = found.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            found.extend(t.elts)
        else:
            out.append(t.value if isinstance(t, ast.Subscript) else t)
    return out


def ownership_breaches(source: str) -> list[str]:
    """Writes to another object's fields: a module-level function that sets an attribute
    of one of its parameters (`run.version = ...`), or a method that sets a field of an
    object it holds (`self.run.version = ...`) instead of calling that object's method."""
    out = []
    tree = ast.parse(source)
    methods = {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
               for f in c.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)}
        for node in ast.walk(fn):
            for t in _assigned(node):
                if not isinstance(t, ast.Attribute):
                    continue
                holder = t.value
                if id(fn) in methods and isinstance(holder, ast.Attribute) and \
                        isinstance(holder.value, ast.Name) and holder.value.id == "self":
                    out.append(f"{fn.name}:{node.lineno} {ast.unparse(t)}")
                elif id(fn) not in methods and isinstance(holder, ast.Name) and \
                        holder.id in params:
                    out.append(f"{fn.name}:{node.lineno} {ast.unparse(t)}")
    return out


def test_ownership_rule_catches_a_function_writing_another_objects_field():
    assert ownership_breaches("def commit(run):\n    run.version += 1\n") == \
        ["commit:2 run.version"]
    assert ownership_breaches("class A:\n    def f(self):\n        self.b.n = 1\n") == \
        ["f:3 self.b.n"]
    assert ownership_breaches("class A:\n    def f(self, x):\n        self.n = x\n") == []


def test_the_syncer_changes_state_only_through_its_owners():
    """Each piece of the run's state has one owner whose methods alone change it
    (syncer/run.py lists them)."""
    breaches = [f"{p.relative_to(ROOT).as_posix()}:{b}"
                for p in sorted((ROOT / "syncer").rglob("*.py")) if "proto" not in p.parts
                for b in ownership_breaches(p.read_text())]
    assert not breaches, breaches


# ---- --help says what a flag does, not what it measured -------------------------------
# A measured figure: a ratio (1.015x, 533× fewer), bytes per parameter as benchmarks
# write them (9.49 B/param; a layout's "8 B per parameter" is a design fact), a
# percentage, a comparison of two numbers ("0.890 vs 0.871"), a number with three or more
# decimals, an approximate figure (~25 s), a rate (MB/s). Defaults ("(default: 0.001)")
# are stripped first: they are settings, not measurements.
MEASURED = re.compile(
    r"\d(\.\d+)?[x×](?![\w.])"          # 1.015x, 533x fewer, 5×
    r"|B/param|bytes/param|\d\.\d+\s?B per param"
    r"|\d\s?%"                          # 2% behind
    r"|\d\s+vs\.?\s+\d"                 # 0.890 vs 0.871
    r"|(?<![\d.])\d+\.\d{3,}(?![\d.])"  # 3.461
    r"|~\s?\d"                          # ~25 s
    r"|\d\s?(k|K|M|G|Mi|Gi)?B/s\b|tokens/s\b")


DEFAULT = re.compile(r"\(default:[^)]*\)")


def _main(module: str, func: str = "main"):
    return getattr(importlib.import_module(module), func)


def _help_entry_points() -> list[tuple[str, Any, list[str]]]:
    """(what a user types, its main function, the arguments before --help)."""
    from yeto.cli import COMMANDS

    out = [("python -m syncer", _main("syncer.__main__"), []),
           ("python -m yeto.learner", _main("yeto.learner"), []),
           ("python -m yeto.sim", _main("yeto.sim.__main__"), []),
           ("python -m yeto.rollout", _main("yeto.rollout.cli"), []),
           ("python -m yeto.rl", _main("yeto.rl.cli"), []),
           ("yeto", _main("yeto.cli"), [])]
    if importlib.util.find_spec("mlx") is not None:
        out.append(("python -m yeto.mlx.learner", _main("yeto.mlx.learner"), []))
    for name, (module, func, _) in COMMANDS.items():
        out.append((f"yeto {name}", _main(module, func), []))
    out.append(("yeto demo --rl", _main("yeto.cli.demo"), ["--rl"]))
    return out


def test_help_texts_hold_no_measured_figures(capsys):
    found, seen = [], 0
    for name, main, pre in _help_entry_points():
        try:
            main([*pre, "--help"])
        except SystemExit:
            pass
        text = " ".join(capsys.readouterr().out.split())  # unwrap argparse's lines
        assert "usage" in text, f"{name} --help printed no usage"
        seen += 1
        for m in MEASURED.finditer(DEFAULT.sub("", text)):
            found.append(f"{name}: ...{text[max(0, m.start() - 60):m.end() + 40]}...")
    assert seen >= 7 and not found, "\n".join(found)


def test_the_figure_check_catches_figures():
    for text in ("1.015x warm", "533x fewer bytes", "about 2% behind", "9.5-9.7 B/param",
                 "9.49 B per parameter",
                 "0.890 vs 0.871", "held-out loss 3.461", "takes ~25 s", "at 900 MB/s"):
        assert MEASURED.search(text), text
    for text in ("(default: 0.001)", "lr 1, momentum 0", "16 x 128-token blocks",
                 "0.0.0.0 for all interfaces", "(prompts x n)", "a 1/7 of it", "every 2 s",
                 "229.7M", "8 B per parameter; 12 with momentum",
                 "BENCHMARKS.md, \"What the evidence says\""):
        assert not MEASURED.search(DEFAULT.sub("", text)), text


# ---- product code does not reach into the command line --------------------------------
def test_no_product_module_imports_yeto_cli():
    """yeto.cli parses arguments over the library; the library never imports it."""
    bad = []
    for folder in ("yeto", "syncer"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel.parts[:2] == ("yeto", "cli") or rel.as_posix() == "yeto/__main__.py":
                continue  # the command itself, and `python -m yeto` that runs it
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                else:
                    continue
                if any(n == "yeto.cli" or n.startswith("yeto.cli.") for n in names):
                    bad.append(f"{rel}:{node.lineno}")
    assert not bad, bad


# ---- tests by cost ----------------------------------------------------------------------
def test_every_test_lives_in_its_tier():
    """tests/unit starts no process and no server; tests/integration starts no process;
    every test file sits in one of the three tiers (tests/conftest.py marks them)."""
    tests = ROOT / "tests"
    loose = sorted(p.name for p in tests.glob("test_*.py"))
    assert not loose, f"test files outside tests/unit, integration, e2e: {loose}"
    process = r"^import subprocess|^from syncer(\.spawn| import spawn)|^from syncer\.spawn"
    server = r"^from helpers\.syncer import .*running_syncer|^from syncer\.service import"
    starts = {"unit": re.compile(f"{process}|{server}", re.M),
              "integration": re.compile(process, re.M)}
    wrong = [f"{tier}/{p.name}" for tier, pattern in starts.items()
             for p in sorted((tests / tier).glob("test_*.py")) if pattern.search(p.read_text())]
    assert not wrong, f"process or server starts in a cheaper tier: {wrong}"


def test_no_test_imports_a_script():
    """scripts/ holds entry points and benchmarks that tests run as programs; what a test
    imports lives in yeto/ (yeto.testing) or tests/helpers, never loaded from scripts/."""
    loads = re.compile(r"sys\.path\.(insert|append)\([^)]*scripts|run_path\([^)]*scripts"
                       r"|spec_from_file_location\([^)]*scripts")
    bad = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "tests").rglob("*.py"))
           for n, line in enumerate(p.read_text().splitlines(), 1) if loads.search(line)]
    assert not bad, f"tests that load a module from scripts/: {bad}"
