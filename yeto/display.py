"""What the `yeto` command and the scripts show: tables and a live view, with `rich`.

One place for terminal output:

- `table(headers, rows, right=...)` builds a rich Table (cells are plain text, never
  read as markup, so ``[::1]:29400`` stays as it is);
- `to_text(renderable)` renders tables and text as plain text: no colour codes, never
  wrapped; what CI logs, files and tests that parse output get;
- `print_table(...)` prints a table: rich's styled table on a terminal, plain text
  elsewhere;
- `Screen` is a command's running output: ``live`` (a region redrawn in place with
  rich's Live, lines printed above it), ``plain`` (lines, and the view printed as text
  when shown) or ``none``;
- `markdown_table`, and the cell formats `cell`, `human_bytes`, `human_seconds`.

A plain table has its columns two spaces apart and one rule under the header:

    island    backend  state
    --------------------------
    island-0  torch    training
"""

from __future__ import annotations

import copy
import io
import math
import os
import sys
from collections.abc import Iterable, Sequence
from typing import IO, Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

MODES = ("live", "plain", "none")
# plain text: no edges, no column rules, one "-" rule under the header
PLAIN_BOX = box.Box("    \n    \n----\n    \n    \n----\n    \n    \n", ascii=True)
PLAIN_WIDTH = 10_000  # plain text is never wrapped


# ---- cells ------------------------------------------------------------------------------
def cell(x: Any) -> str:
    """A table cell: None as "-", floats to a few significant digits (thousands grouped
    from 100 up), anything else as str."""
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.1f}" if abs(x) >= 100 else f"{x:.3g}"
    return str(x)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def human_seconds(s: float | None) -> str:
    if s is None or s < 0 or not math.isfinite(s):
        return "-"
    if s < 60:
        return f"{s:.1f}s" if s < 10 else f"{s:.0f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


# ---- tables -------------------------------------------------------------------------------
def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, title: str | None = None,
          right: Iterable[int] = ()) -> Table:
    """A rich Table of `rows` (each cell through `cell`); columns whose index is in
    `right` are right-aligned (numbers)."""
    right = set(right)
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, header_style="bold",
              title=Text(title) if title else None, title_justify="left")
    for i, h in enumerate(headers):
        t.add_column(Text(str(h)), justify="right" if i in right else "left", no_wrap=True)
    for r in rows:
        t.add_row(*(Text(cell(c)) for c in r))
    return t


def table_text(headers: Sequence[str], rows: Iterable[Sequence[Any]], **kw) -> str:
    """`table(...)` as plain text."""
    return to_text(table(headers, rows, **kw))


def print_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *,
                file: IO | None = None, **kw) -> None:
    """Print a table: styled on a terminal, plain text elsewhere (logs, pipes)."""
    show(table(headers, rows, **kw), file)


def show(renderable: RenderableType, file: IO | None = None) -> None:
    """Print anything `to_text` takes: styled on a terminal, plain text elsewhere."""
    file = file or sys.stdout
    if is_terminal(file):
        _console(file).print(renderable)
    else:
        file.write(to_text(renderable) + "\n")
    file.flush()


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table (for BENCHMARKS.md and the like)."""
    out = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def to_text(renderable: RenderableType) -> str:
    """Plain text of a renderable (a str, Text, Table, or a Group of them): tables in
    the plain style, no colour or style codes, no wrapping, no trailing blanks."""
    buf = io.StringIO()
    Console(file=buf, width=PLAIN_WIDTH, color_system=None, force_terminal=False,
            no_color=True, highlight=False, emoji=False, markup=False,
            soft_wrap=False).print(_plain(renderable))
    return "\n".join(line.rstrip() for line in buf.getvalue().rstrip("\n").splitlines())


def _plain(r: RenderableType) -> RenderableType:
    if isinstance(r, Table):
        t = copy.copy(r)
        t.box, t.show_edge, t.pad_edge, t.header_style = PLAIN_BOX, False, False, ""
        t.padding = (0, 1, 0, 0)  # with the box's blank divider: columns 2 spaces apart
        return t
    if isinstance(r, Group):
        return Group(*(_plain(x) for x in r.renderables))
    if isinstance(r, str):
        return Text(r)
    return r


# ---- running output -------------------------------------------------------------------------
def is_terminal(stream: IO) -> bool:
    """A terminal that can redraw (not a pipe, a file, or TERM=dumb)."""
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        return False
    return bool(tty) and os.environ.get("TERM") != "dumb"


def _console(stream: IO) -> Console:
    return Console(file=stream, highlight=False, emoji=False, markup=False)


class Screen:
    """A command's running output.

    live:  `show(view)` redraws one region in place (rich Live); `say(line)` prints
           above it; `close(final)` leaves the final view on screen.
    plain: `say` prints a line; `show` prints the view as plain text (for logs).
    none:  quiet.
    mode "auto" is live on a terminal, plain elsewhere.
    """

    def __init__(self, mode: str = "auto", stream: IO | None = None):
        self.stream = stream or sys.stdout
        if mode == "auto":
            mode = "live" if is_terminal(self.stream) else "plain"
        if mode not in MODES:
            raise ValueError(f"display mode {mode!r}: use one of auto, {', '.join(MODES)}")
        self.mode = mode
        self._console = _console(self.stream) if mode == "live" else None
        self._live: Live | None = None

    def say(self, text: str) -> None:
        if self.mode == "none":
            return
        if self._console is not None:
            self._console.print(Text(text))  # above the live region while one is shown
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def show(self, view: RenderableType) -> None:
        if self.mode == "none":
            return
        if self._console is None:
            self.stream.write(to_text(view) + "\n")
            self.stream.flush()
            return
        if self._live is None:
            self._live = Live(view, console=self._console, auto_refresh=False,
                              redirect_stdout=True, redirect_stderr=True)
            self._live.start()
        self._live.update(view, refresh=True)

    def close(self, final: RenderableType | None = None) -> None:
        """End the live region (its last view stays); `final`, if given, is shown last."""
        if self._live is not None:
            if final is not None:
                self._live.update(final, refresh=True)
            self._live.stop()
            self._live = None
        elif final is not None:
            self.show(final)
