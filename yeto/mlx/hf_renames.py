"""Checkpoint tensor names -> the module paths transformers 5 loads them into.

transformers 5 renames some architectures' modules at load time and renames them
back when it saves (``transformers/conversion_mapping.py``: exaone's
``transformer.h.N.attn.attention.q_proj`` is ``model.layers.N.self_attn.q_proj``,
nemotron_h's ``backbone.`` is ``model.``, ...). peft names LoRA tensors by the
loaded module paths, so the MLX island, which reads the checkpoint's names, must
apply the same renames. It cannot import transformers' loader (that needs
torch), so `renamer` reads the rename rules from transformers' own
``conversion_mapping.py``: the statements that build its table are run one by one
with light stand-ins for the transform classes (a statement that needs the real
classes is skipped, and only ``WeightRenaming`` rules are kept: the others fuse
or split tensors, which `yeto.mlx.hf_paths` refuses anyway), and the rules are
applied with transformers' matching (`Renaming`). tests/integration/test_targets.py checks
the result against transformers itself.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import logging
import re
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("yeto.mlx.hf_renames")


class _Transform:
    """Stand-in for transformers' weight transforms: keeps the patterns only."""

    def __init__(self, *args, **kwargs):
        src = kwargs.get("source_patterns", args[0] if args else None)
        tgt = kwargs.get("target_patterns", args[1] if len(args) > 1 else None)
        self.source_patterns = _as_list(src)
        self.target_patterns = _as_list(tgt)
        self._original_source_patterns = list(self.source_patterns)
        self._original_target_patterns = list(self.target_patterns)

    def copy(self):
        return type(self)(list(self.source_patterns), list(self.target_patterns))


def _as_list(v) -> list[str]:
    if isinstance(v, str):
        return [v]
    return [x for x in v if isinstance(x, str)] if isinstance(v, (list, tuple)) else []


class Renaming:
    """One ``WeightRenaming``, matched as transformers matches it (longest source
    first, ``*.`` as any prefix, a name boundary at the end, the first target as the
    replacement, one capturing group carried over)."""

    def __init__(self, sources: list[str], targets: list[str]):
        group = None
        self.targets = []
        for t in targets:
            t = re.sub(r"\(\?.+?\)?\)", "", t.removeprefix("^"))
            m = re.search(r"\(.+?\)", t)
            if m:
                group, t = m.group(0), t.replace(m.group(0), r"\1", 1)
            self.targets.append(t.replace(r"\.", "."))
        fixed = []
        for i, s in enumerate(sources):
            if r"\1" in s and group is not None:
                s = s.replace(r"\1", group, 1)
            paired = len(sources) == len(targets)
            if paired and targets[i].startswith("^") and not s.startswith("^"):
                s = "^" + s
            fixed.append(s)
        branches = []
        for i, s in sorted(enumerate(fixed), key=lambda item: -len(item[1])):
            p = s.replace("*.", r".*\.")
            end = r"(?!\w)" if re.search(r"[a-zA-Z0-9]$", p) else ""
            branches.append(f"(?P<g{i}>{p}{end})")
        self.pattern = re.compile("|".join(branches))

    def __call__(self, key: str) -> str:
        m = self.pattern.search(key)
        if m is None:
            return key
        replacement = self.targets[0]
        if r"\1" in replacement:
            name = next(n for n, v in m.groupdict().items() if v is not None)
            replacement = replacement.replace(r"\1", m.group(self.pattern.groupindex[name] + 1))
        return key.replace(m.group(0), replacement, 1)


def _source() -> str | None:
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "conversion_mapping.py"
    return path.read_text() if path.is_file() else None


def _stand_ins(tree: ast.Module) -> dict:
    """The names conversion_mapping.py imports from core_model_loading, as stand-ins."""
    ns: dict = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "core_model_loading":
            for alias in node.names:
                ns[alias.asname or alias.name] = type(alias.name, (_Transform,), {})
    return ns


@functools.lru_cache(maxsize=1)
def _table() -> dict[str, list]:
    """transformers' {model type or class name: [transform, ...]}, stand-ins only."""
    text = _source()
    if text is None:
        return {}
    tree = ast.parse(text)
    ns = _stand_ins(tree)
    for node in tree.body:  # module-level constants such as _MODEL_TO_CONVERSION_PATTERN
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            try:
                exec(compile(ast.Module([node], []), "conversion_mapping", "exec"), ns)  # noqa: S102
            except Exception:  # noqa: BLE001, S110 - a constant we do not need
                pass
    build = next((n for n in tree.body if isinstance(n, ast.FunctionDef)
                  and n.name == "_build_checkpoint_conversion_mapping"), None)
    if build is None:
        return {}
    skipped = 0
    for stmt in build.body:
        if isinstance(stmt, ast.Return):
            break
        try:
            exec(compile(ast.Module([stmt], []), "conversion_mapping", "exec"), ns)  # noqa: S102
        except Exception:  # noqa: BLE001 - needs the real classes: those types keep no renames
            skipped += 1
    log.debug("transformers rename table: %d statements skipped", skipped)
    return ns.get("mapping", {})


def renamer(config: dict) -> Callable[[str], str]:
    """checkpoint key -> the key transformers 5 loads it as, for this config
    (looked up by architecture class name, then by model type, then transformers'
    "legacy" renames, as transformers does). The identity when nothing applies."""
    table = _table()
    arch = (config.get("architectures") or [None])[0]
    transforms = [*(table.get(arch) or table.get(config.get("model_type")) or []),
                  *table.get("legacy", [])]
    rules = [Renaming(t.source_patterns, t.target_patterns) for t in transforms
             if type(t).__name__ == "WeightRenaming" and t.source_patterns and t.target_patterns]

    def rename(key: str) -> str:
        for rule in rules:
            key = rule(key)
        return key

    return rename
