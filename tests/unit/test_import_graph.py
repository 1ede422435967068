"""The import graph of `yeto/` and `syncer/`: no circles, and a syncer that never
reaches a training backend.

The graph is read from the source with `ast`. Every `import` and `from ... import`
anywhere in a module is an edge, those inside functions included (they run the first
time the function does, and a circle through them is still a circle), and so is one
under `if TYPE_CHECKING:`: a type ties two modules too, so a module names no type from a
module above it.
An edge goes to the module an import names: `import a.b.c` and `from a.b import c` (c a
module) lead to `a.b.c`; `from a.b import name` (name not a module) leads to `a.b`, the
package's `__init__` when `a.b` is a package. The packages Python runs on the way down
(`a`, `a.b`) are not edges of the circle check (a package's `__init__` importing its own
modules is no circle), but the syncer check follows their module-level imports, which
run with every import below them. Imports by computed name (`importlib.import_module`
over a table of module names, as `yeto.cli` dispatches its commands) are not in the
graph."""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("yeto", "syncer")

# Circles among the syncer's round-path modules (run, commit, intake, persist, staging,
# stepping, merge, members, pacing, broadcast), being taken apart into typed owner
# classes: each set of modules here is left out of the circle check while the owners
# are built, and must still be a circle (a test checks), so the list only shrinks. Empty:
# no circle is left to wait for.
PENDING_SYNCER_CYCLES: list[frozenset[str]] = []

# What the syncer may never reach through any chain of imports: the training backends
# and the project's modules built on them.
SYNCER_FORBIDDEN = ("torch", "transformers", "peft", "mlx", "mlx_lm",
                    "yeto.mlx", "yeto.torch", "yeto.interop")


# ---- the graph ---------------------------------------------------------------------------
def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """{dotted name: file} for every module of the project's packages under `root`."""
    return {module_name(p, root): p
            for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))}


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` names, relative levels resolved."""
    if node.level == 0:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _in_functions(tree: ast.Module) -> set[int]:
    """The ids of the import statements inside a function (they run when it is called)."""
    return {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef,
                                                              ast.AsyncFunctionDef, ast.Lambda))
            for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}


def imports_of(module: str, path: Path, known: set[str]) -> dict[str, bool]:
    """{module imported: whether at module level (it runs with the import of `module`)}
    for every import in the file: project modules by their full name, outside ones as
    written (`torch`, `google.protobuf`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    later = _in_functions(tree)
    out: dict[str, bool] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, path.name == "__init__.py", node)
            names = {f"{base}.{a.name}" for a in node.names} & known
            if len(names) < len(node.names):  # a name that is not a module: the base
                names.add(base)
        else:
            continue
        for name in names - {module}:
            out[name] = out.get(name, False) or id(node) not in later
    return out


class Graph:
    """The modules of `root`'s packages and what each imports."""

    def __init__(self, root: Path = ROOT):
        modules = project_modules(root)
        self.imports = {m: imports_of(m, p, set(modules)) for m, p in modules.items()}

    def edges(self, module: str, everywhere: bool = True) -> list[str]:
        """What `module` imports (outside modules included), at module level only
        unless `everywhere`."""
        found = self.imports.get(module, {})
        return sorted(m for m, top in found.items() if everywhere or top)

    def cycles(self) -> list[frozenset[str]]:
        """The strongly connected components of more than one module (Tarjan's
        algorithm): modules that reach each other through their imports."""
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        found: list[frozenset[str]] = []

        def visit(v: str) -> None:
            index[v] = low[v] = len(index)
            stack.append(v)
            for w in self.edges(v):
                if w not in self.imports:
                    continue  # outside the project
                if w not in index:
                    visit(w)
                    low[v] = min(low[v], low[w])
                elif w in stack:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                component = {stack.pop()}
                while v not in component:
                    component.add(stack.pop())
                if len(component) > 1:
                    found.append(frozenset(component))

        for v in sorted(self.imports):
            if v not in index:
                visit(v)
        return found

    def a_cycle(self, component: frozenset[str]) -> list[str]:
        """One shortest circle through the first module of `component`, as a path."""
        start = min(component)
        came = {start: ""}
        todo = deque([start])
        while todo:
            v = todo.popleft()
            for w in self.edges(v):
                if w == start:
                    path = [v]
                    while came[path[-1]]:
                        path.append(came[path[-1]])
                    return [*reversed(path), start]
                if w in component and w not in came:
                    came[w] = v
                    todo.append(w)
        raise ValueError(f"{sorted(component)} is no circle")

    def reach(self, starts: list[str], stop=lambda m: False) -> dict[str, str]:
        """{module: a shortest chain of imports to it from one of `starts`} for every
        module they bring in, outside ones included, going no further than a module
        `stop` says. A module imported by name runs all of its imports; a package
        Python runs on the way down to one ("[package]" in the chain) runs those at
        its module level."""
        chain = {(s, True): s for s in starts}
        todo = deque(chain)
        while todo:
            v, named = todo.popleft()
            if stop(v):
                continue
            parts = v.split(".")
            packages = [".".join(parts[:i]) for i in range(1, len(parts))]
            steps = [(w, True, w) for w in self.edges(v, everywhere=named)] + \
                [(p, False, f"{p} [package]") for p in packages if p in self.imports]
            for w, w_named, label in steps:
                if (w, w_named) not in chain:
                    chain[(w, w_named)] = f"{chain[(v, named)]} -> {label}"
                    todo.append((w, w_named))
        out: dict[str, str] = {}
        for (m, _), c in sorted(chain.items(), key=lambda kv: kv[1].count("->")):
            out.setdefault(m, c)
        return out


def forbidden_for_the_syncer(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in SYNCER_FORBIDDEN)


# ---- the checks --------------------------------------------------------------------------
def test_no_module_imports_itself_through_others():
    graph = Graph()
    found = [c for c in graph.cycles() if c not in set(PENDING_SYNCER_CYCLES)]
    assert not found, "import circles (each: its modules; e.g. one circle through them):\n" + \
        "\n".join(f"{', '.join(sorted(c))}\n    e.g. {' -> '.join(graph.a_cycle(c))}"
                  for c in found)


def test_each_pending_syncer_cycle_still_exists():
    """A listed circle that is gone comes off the list."""
    found = set(Graph().cycles())
    gone = [sorted(c) for c in PENDING_SYNCER_CYCLES if c not in found]
    assert not gone, f"no longer a circle, take it off PENDING_SYNCER_CYCLES: {gone}"


def test_the_syncer_never_reaches_a_training_backend():
    graph = Graph()
    syncer = [m for m in graph.imports if m.split(".")[0] == "syncer"]
    reached = graph.reach(syncer, stop=forbidden_for_the_syncer)
    bad = [chain for m, chain in sorted(reached.items()) if forbidden_for_the_syncer(m)]
    assert not bad, "the syncer reaches a training backend:\n" + "\n".join(bad)


# ---- the checks catch what they look for -------------------------------------------------
def _package(tmp_path: Path, files: dict[str, str]) -> Graph:
    for rel, text in {"yeto/__init__.py": "", **files}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return Graph(tmp_path)


def test_a_circle_through_a_function_level_import_is_found(tmp_path):
    graph = _package(tmp_path, {
        "yeto/a.py": "from yeto import b\n",
        "yeto/b.py": "def f():\n    from . import c\n",
        "yeto/c.py": "import yeto.a\n",
        "yeto/d.py": "from .a import name\n",
        "yeto/e.py": ("from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from yeto import f\n"),
        "yeto/f.py": "from yeto import e\n",  # a type-only import counts too
    })
    assert graph.edges("yeto.b") == ["yeto.c"] and graph.edges("yeto.b", everywhere=False) == []
    assert graph.edges("yeto.d") == ["yeto.a"]
    abc = frozenset({"yeto.a", "yeto.b", "yeto.c"})
    assert sorted(map(sorted, graph.cycles())) == [sorted(abc), ["yeto.e", "yeto.f"]]
    assert graph.a_cycle(abc) == ["yeto.a", "yeto.b", "yeto.c", "yeto.a"]


def test_the_syncer_check_follows_functions_and_packages_run_on_the_way(tmp_path):
    graph = _package(tmp_path, {
        "syncer/__init__.py": "",
        "syncer/a.py": "import numpy\nfrom yeto.data import b\n",
        "yeto/data/__init__.py": "from yeto.data import c\n\ndef f():\n    import peft\n",
        "yeto/data/b.py": "def f():\n    from yeto.mlx import d\n",
        "yeto/data/c.py": "import torch.nn\n",
        "yeto/mlx/__init__.py": "",
        "yeto/mlx/d.py": "import mlx.core\n",
    })
    reached = graph.reach(["syncer.a"], stop=forbidden_for_the_syncer)
    assert sorted(m for m in reached if forbidden_for_the_syncer(m)) == ["torch.nn", "yeto.mlx.d"]
    assert reached["torch.nn"] == \
        "syncer.a -> yeto.data.b -> yeto.data [package] -> yeto.data.c -> torch.nn"
    assert "mlx.core" not in reached and "peft" not in reached  # past a stop; never called
