"""The docs' commands run: every ```bash block of README.md and docs/ either runs here
or says why not.

The unmarked blocks of README.md and of each how-to guide (docs/how-to/*.md) run in
order, a page at a time, in a fresh folder laid out like a checkout (examples/ and
scripts/ linked in), with this venv's bin first on PATH, on loopback, CPU only and
without network: the tiny model and task are built by the blocks themselves
(`yeto make-tiny-model`, `yeto make-task`, cached per machine). The ports the docs
use (29400 for the syncer, 8081 for a rollout node) are replaced by free ones. Each
page then must show what it promises (EXPECT: files written, lines printed, adapters
identical).

A block that cannot run here (a second machine, a GPU, a download, root) has
`<!-- not run here: REASON -->` on the line before it. On the other pages (concepts,
tools, ...) every bash block must carry that line. README.md's first block is the
set-up line that CI runs itself (.ci/run).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the venv running the tests: yeto, python, torchrun
DOCS = ROOT / "docs"
RUN_PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (DOCS / "how-to").glob("*.md"))]
ALL_PAGES = RUN_PAGES + sorted(str(p.relative_to(ROOT)) for p in DOCS.rglob("*.md")
                               if "reference" not in p.relative_to(DOCS).parts
                               and p.parent != DOCS / "how-to")
SETUP = ("bash scripts/setup.sh && .venv/bin/yeto demo            # set up, then a local "
         "federated run\n"
         "bash scripts/setup.sh && .venv/bin/python -m pytest     # set up, then the tests\n")
MARK = re.compile(r"<!--\s*not run here:\s*(\S.*?)\s*-->")
FENCE = re.compile(r"^```(\S*)\s*$")
SHELLS = {"sh", "shell", "console", "zsh", "shell-session"}  # commands must be ```bash
PORTS = ("29400", "8081")
BLOCK_TIMEOUT_S = 180


@dataclass
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    reason: str | None  # the marker's reason, None when unmarked


def blocks(page: str) -> list[Block]:
    """The fenced blocks of a page, each with the marker on the line before it."""
    lines = (ROOT / page).read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = MARK.fullmatch(before)
        out.append(Block(page, i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n",
                         mark.group(1) if mark else None))
        i = end + 1
    return out


def runnable(page: str) -> list[Block]:
    found = [b for b in blocks(page) if b.lang == "bash" and b.reason is None]
    return found[1:] if page == "README.md" else found  # README's first: the set-up line


# ---- what each page's commands must leave behind ----------------------------------------
def _adapter(d: str) -> str:
    return f"{d}/adapter/adapter_model.safetensors"


EXPECT = {
    "README.md": dict(
        files=[_adapter("runs/quick/island-0"), "runs/quick/syncer/tape.jsonl"],
        printed=[r"island-1 held-out loss after training: \d"],
        same=[(_adapter("runs/quick/island-0"), _adapter("runs/quick/island-1")),
              (_adapter("runs/quick/island-0"),
               "runs/quick/syncer/final/adapter_model.safetensors")]),
    "docs/how-to/mac-and-cuda.md": dict(
        files=["runs/mix/island-1/mlx/adapters.safetensors"],
        printed=[r"island-1 held-out loss after training: \d"],
        same=[(_adapter("runs/mix/island-0"), _adapter("runs/mix/island-1"))]),
    "docs/how-to/full-weights-fsdp.md": dict(
        files=["runs/fsdp/island-0/model/config.json", "runs/fsdp/island-0/rank-1.jsonl"],
        printed=[r"held-out loss after training: \d", r"round 2 \(fragment 0\) committed"],
        same=[]),
    "docs/how-to/rl-rollout-nodes.md": dict(
        files=[_adapter("runs/rl/grpo-0"), "runs/rl/grpo-0/metrics.jsonl"],
        printed=[r"held-out reward after training: \d", r"rollout weights version 1 applied"],
        same=[]),
    "docs/how-to/internet.md": dict(
        files=[_adapter("runs/tls/island-0")],
        printed=[r"round 2 \(fragment 0\) committed"],
        same=[]),
    "docs/how-to/your-training-loop.md": dict(
        files=["runs/loop/island-2/adapters.safetensors"],
        printed=[r"round 2 \(fragment 0\) committed \(all\): 3 pushes"],
        same=[(_adapter("runs/loop/island-0"), _adapter("runs/loop/island-1"))]),
    "docs/how-to/new-architecture.md": dict(
        files=["runs/qwen3/config.json"], printed=[r"parity: OK, \d+ tensors"], same=[]),
    "docs/how-to/recover-from-a-crash.md": dict(
        files=[_adapter("runs/crash/island-0")],
        printed=[r'"event": ?"resumed"', r"resumed run \w+ at version [1-9]"],
        same=[]),
}


# ---- every block runs or says why ---------------------------------------------------------
def test_every_bash_block_runs_or_says_why():
    unmarked_elsewhere, other_shells, empty = [], [], []
    for page in ALL_PAGES:
        for b in blocks(page):
            where = f"{page}:{b.line}"
            if b.lang in SHELLS:
                other_shells.append(where)
            if b.lang == "bash" and b.reason is None and page not in RUN_PAGES:
                unmarked_elsewhere.append(where)
            if b.lang == "bash" and not b.text.strip():
                empty.append(where)
    assert not other_shells, f"commands go in ```bash blocks (this test sees those): {other_shells}"
    assert not unmarked_elsewhere, ("bash blocks on pages this test does not run need "
                                    "'<!-- not run here: REASON -->' before them: "
                                    f"{unmarked_elsewhere}")
    assert not empty, empty
    with_commands = {p for p in RUN_PAGES if runnable(p)}
    assert with_commands == set(EXPECT), (
        "each page with blocks that run needs its outcome in EXPECT (and only those): "
        f"{sorted(with_commands ^ set(EXPECT))}")


def test_readme_starts_with_the_setup_lines_and_is_short():
    text = (ROOT / "README.md").read_text()
    first = blocks("README.md")[0]
    assert first.lang == "bash" and first.text == SETUP and first.line <= 3
    assert text.count("\n") <= 150, f"README.md has {text.count(chr(10))} lines (150 at most)"
    assert SETUP.splitlines()[1].split("  ")[0] in (ROOT / ".ci" / "run").read_text()


def test_theta_is_defined_where_a_page_first_uses_it():
    """Θ is the run's shared weights; each page says so where it first writes Θ."""
    late = []
    for page in ALL_PAGES:
        text = (ROOT / page).read_text()
        if "Θ" in text:
            line = text[:text.index("Θ")].count("\n")
            around = " ".join(text.splitlines()[line:line + 2]).lower()
            if "theta" not in around and "shared weights" not in around:
                late.append(f"{page}:{line + 1}")
    assert not late, f"Θ used before the page says what it is (the run's shared weights): {late}"


def test_doc_links_point_at_files_that_exist():
    broken = []
    for page in ALL_PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / page).read_text()):
            if re.match(r"[a-z]+:", target) or target.rstrip("/").endswith("reference"):
                continue  # web links; docs/reference/ is generated elsewhere
            if not ((ROOT / page).parent / target).exists():
                broken.append(f"{page}: {target}")
    assert not broken, broken


# ---- the pages' commands, run ---------------------------------------------------------
def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _run_block(block: Block, work: Path, ports: dict[str, str]) -> str:
    text = block.text
    for doc_port, port in ports.items():
        text = text.replace(doc_port, port)
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_") or k == "YETO_CACHE"}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", text], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{block.page}:{block.line} ran over {BLOCK_TIMEOUT_S} s:\n{out[-4000:]}")
    finally:
        try:  # whatever the block left running in the background (a syncer, a node)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    where = f"{block.page}:{block.line}"
    assert proc.returncode == 0, f"{where} exited {proc.returncode}:\n{out[-4000:]}"
    return out


def _tensors_equal(a: Path, b: Path) -> bool:
    ta, tb = load_file(str(a)), load_file(str(b))
    return ta.keys() == tb.keys() and all(np.array_equal(ta[k], tb[k]) for k in ta)


# minute-scale pages (.ci/run runs them after the default tier, with `-m long`)
LONG_PAGES = ("docs/how-to/your-training-loop.md", "docs/how-to/mac-and-cuda.md",
              "docs/how-to/recover-from-a-crash.md", "docs/how-to/full-weights-fsdp.md",
              "docs/how-to/rl-rollout-nodes.md", "docs/how-to/internet.md")


@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.long) if p in LONG_PAGES
                                  else p for p in EXPECT])
def test_the_page_commands_run(page, tmp_path):
    work = tmp_path / "checkout"
    work.mkdir()
    for name in ("examples", "scripts"):
        (work / name).symlink_to(ROOT / name)
    ports = {p: _free_port() for p in PORTS}
    out = "".join(_run_block(b, work, ports) for b in runnable(page))
    want = EXPECT[page]
    missing = [f for f in want["files"] + [x for pair in want["same"] for x in pair]
               if not (work / f).is_file()]
    assert not missing, f"{page}: not written: {missing}\n{out[-4000:]}"
    unprinted = [p for p in want["printed"] if not re.search(p, out)]
    assert not unprinted, f"{page}: never printed: {unprinted}\n{out[-4000:]}"
    for a, b in want["same"]:
        assert _tensors_equal(work / a, work / b), f"{page}: {a} and {b} differ"
