"""Write docs/reference/: every `yeto` command's flags (its --help) and every run-file
key, generated from the parsers themselves, so the reference cannot drift from the code.

    python scripts/gen_reference.py              # (re)write docs/reference/
    python scripts/gen_reference.py --check      # exit 1 naming the stale files

tests/unit/test_reference.py runs the check.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "reference"
WIDTH = "100"  # --help wraps to $COLUMNS: fixed, so the pages do not depend on a terminal
# the programs whose flags a run file sets: (title, module with build_parser, role)
PARSERS = [("yeto syncer", "syncer.__main__", "syncer"),
           ("yeto island --backend torch", "yeto.torch.learner", "island"),
           ("yeto island --backend mlx", "yeto.mlx.learner", "island"),
           ("yeto launch", "yeto.cli.launch", "launch"),
           ("yeto sim", "yeto.sim.__main__", "sim"),
           ("yeto rl", "yeto.rl.cli", "rl"),
           ("yeto rollout", "yeto.rollout.cli", "rollout")]


def help_text(module: str, func: str, argv: list[str]) -> str:
    """What `--help` prints for a command's main."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        getattr(importlib.import_module(module), func)(argv)
    return buf.getvalue().rstrip() + "\n"


def command_pages() -> dict[str, str]:
    from yeto.cli import COMMANDS

    pages = {}
    for name, (module, func, text) in COMMANDS.items():
        helps = [("", module, func, ["--help"])]
        if name == "island":  # one page, both backends
            helps = [(f"### --backend {b}\n\n", "yeto.cli.island", "main",
                      ["--backend", b, "--help"]) for b in ("torch", "mlx")]
        body = "".join(f"{head}```text\n{help_text(m, f, argv)}```\n\n"
                       for head, m, f, argv in helps)
        pages[f"{name}.md"] = f"# yeto {name}\n\n{text}.\n\n{body}".rstrip() + "\n"
    return pages


# which programs' flags each section holds (a program reading a section takes the keys
# it has a flag for)
OWNERS = {"syncer": ("yeto syncer",), "island": ("yeto island --backend torch",
                                                 "yeto island --backend mlx"),
          "rl": ("yeto rl",), "rollout": ("yeto rollout",), "launch": ("yeto launch",)}


def _flags(title: str) -> list[argparse.Action]:
    module = next(m for t, m, _ in PARSERS if t == title)
    p = importlib.import_module(module).build_parser()
    return [a for a in p._actions if a.option_strings and a.dest not in ("help", "config")]


def _readers(section: str, dest: str) -> str:
    from yeto import runfile

    return ", ".join(t.removeprefix("yeto ") for t, _, role in PARSERS
                     if section in runfile.ROLES[role] and dest in {a.dest for a in _flags(t)})


def _section_rows(section: str, prefix: str = "", skip: set = frozenset()) -> list[str]:
    from yeto import runfile

    rows = {}
    for title in OWNERS.get(section, OWNERS["island"]):
        for a in _flags(title):
            key = a.dest.removeprefix(prefix)
            if a.dest in skip or (prefix and key == a.dest) or key in rows:
                continue
            text = (a.help or "").replace("|", "\\|").replace("%%", "%").replace("\n", " ")
            rows[key] = (f"| `{key}` | `{a.option_strings[-1]}` | `{a.default}` | "
                         f"{_readers(section if section in runfile.SECTIONS else 'island', a.dest)}"
                         f" | {text} |")
    return ["| key | flag | default | read by | what it does |", "|---|---|---|---|---|",
            *(rows[k] for k in sorted(rows)), ""]


def run_file_page() -> str:
    from yeto import runfile

    island = {a.dest for a in _flags("yeto island --backend torch")}
    lines = ["# The run file (`--config run.toml`)", "", runfile.__doc__.strip(), "",
             "## [run]", "", "Shared by every program that has the flag: "
             + ", ".join(f"`{k}`" for k in runfile.RUN_KEYS) + ".", "",
             "## [syncer]", "", *_section_rows("syncer"),
             "## [island] and [data]", "", "The islands' flags (torch and MLX; the sim and "
             "the GRPO island take them too). `[data]` takes the same keys: put the data "
             "ones there.", "", *_section_rows("island", skip={d for d in island
                                                              if d.startswith("lora_")}),
             "## [lora]", "", *_section_rows("lora", prefix="lora_"),
             "## [rl]", "", *_section_rows("rl", skip=island),
             "## [rollout]", "", *_section_rows("rollout"),
             "## [launch]", "", *_section_rows("launch")]
    return "\n".join(lines).rstrip() + "\n"


def pages() -> dict[str, str]:
    os.environ["COLUMNS"] = WIDTH
    os.environ.pop("YETO_TOKEN", None)
    out = command_pages()
    out["run-file.md"] = run_file_page()
    out["README.md"] = ("# Reference\n\nGenerated by `python scripts/gen_reference.py` from "
                        "the parsers; do not edit by hand.\n\n"
                        + "".join(f"- [{n.removesuffix('.md')}]({n})\n" for n in sorted(out)))
    return out


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
