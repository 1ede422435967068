"""What `yeto launch` shows: a headline and a row per island (live, redrawn in place;
or plain, a line per merged round), from a `LocalRun` and its `Progress`."""

from __future__ import annotations

import math
import time

from rich.console import Group
from rich.text import Text

from yeto.cli.local_run import LocalRun
from yeto.cli.progress import IslandProc
from yeto.display import Screen, human_bytes, human_seconds, table, to_text

ISLAND_COLUMNS = ["island", "backend", "step", "train loss", "held-out", "loss tok/s", "round",
                  "pushes", "state"]


def _loss(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.3f}"


def run_state(run: LocalRun) -> str:
    merges, status = run.progress.merges, run.progress.status
    if run.stopping and run.running():
        return "stopping: " + run.stopping
    if status.get("finished") or (run.syncer and run.syncer.poll() == 0 and not
                                  (run.hard_stop and not merges)):
        return "finished"
    if run.stopping:
        return "stopped: " + run.stopping
    return "training" if merges or status.get("version") else "starting"


def headline(run: LocalRun) -> str:
    m = run.progress.merges
    waiting = run.waiting_slots()
    wait = f"  waiting for {len(waiting)} external island{'s' if len(waiting) > 1 else ''}" \
        if waiting else ""
    return (f"syncer {run.join_address or run.address}  {run_state(run)}{wait}  "
            f"round {m[-1]['round'] if m else 0}  "
            f"merges {len(m)}  merged pushes "
            f"{human_bytes(sum(r.get('bytes_in', 0) for r in m))}  broadcasts "
            f"{human_bytes(sum(r.get('bytes_out', 0) for r in m))}  "
            f"rejected {run.progress.rejected}  {human_seconds(time.monotonic() - run.t0)}")


def island_row(run: LocalRun, isl: IslandProc) -> list[str]:
    steps, rate = run.cfg.max_steps, run.progress.rate(isl)
    if isl.external and not isl.syncer_state:
        return [isl.id, isl.backend, "-", "-", "-", "-", "-", "0", isl.state]
    return [isl.id, isl.backend, f"{isl.step}/{steps}" if steps else str(isl.step),
            _loss(isl.train_loss), _loss(isl.eval_loss),
            "-" if rate is None else f"{rate:,.0f}",
            "-" if isl.version is None or isl.version < 0 else str(isl.version),
            str(isl.pushes), isl.state]


def view(run: LocalRun) -> Group:
    """The run at a glance: a headline and a row per island."""
    islands = sorted(run.islands, key=lambda i: (len(i.id), i.id))  # island-2 before -10
    return Group(Text(headline(run)),
                 table(ISLAND_COLUMNS, [island_row(run, isl) for isl in islands]))


def render_table(run: LocalRun) -> str:
    """`view` as plain text."""
    return to_text(view(run))


def merge_line(r: dict) -> str:
    parts = [f"{x['learner']} {x['tokens']} tok"
             + (f" eval {x['eval_loss']:.3f}" if x.get("eval_loss") is not None else "")
             for x in r.get("responders", [])]
    return f"round {r['round']:3d}: " + ", ".join(parts)


def event_lines(new: list[dict], exited: list[IslandProc]) -> list[str]:
    """A line per merged round, refused message and exited island."""
    lines = [merge_line(r) for r in new if r.get("event") == "merge"]
    lines += [f"rejected: {r.get('learner')} {r.get('kind')}: {r.get('detail')}"
              for r in new if r.get("event") == "rejected"]
    lines += [f"{isl.id} exited with code {isl.code}" if isl.code else
              f"{isl.id} done at step {isl.step}" for isl in exited]
    return lines


def status_lines(run: LocalRun) -> list[str]:
    """The view as lines that stand alone (a log file, a pipe): the headline, then a
    line per island naming each value."""
    islands = sorted(run.islands, key=lambda i: (len(i.id), i.id))
    return [headline(run)] + [
        "  " + "  ".join(f"{h} {v}" for h, v in zip(ISLAND_COLUMNS, island_row(run, isl)))
        for isl in islands]


class Display:
    """live: the run's view redrawn in place (a terminal), event lines above it; plain:
    a line per merged round and per island that exits, and every `status_every_s` a
    line per island (no table: one line per event in a log file); none: quiet. The
    last view is a table in both."""

    def __init__(self, mode: str, stream=None, status_every_s: float = 30.0):
        self.screen = Screen(mode, stream)
        self.mode = self.screen.mode
        self.status_every_s = status_every_s
        self._last_view = time.monotonic()

    def say(self, text: str) -> None:
        self.screen.say(text)

    def update(self, run: LocalRun, new: list[dict], exited: list[IslandProc]) -> None:
        notes, run.progress.notes = run.progress.notes, []
        if self.mode == "none":
            return
        for line in notes + event_lines(new, exited):
            self.screen.say(line)
        if self.mode == "live":
            self.screen.show(view(run))
        elif time.monotonic() - self._last_view >= self.status_every_s:
            self._last_view = time.monotonic()
            for line in status_lines(run):
                self.screen.say(line)

    def show(self, run: LocalRun) -> None:
        """The run's view now (plain: printed once; live: redrawn)."""
        if self.mode != "none":
            self._last_view = time.monotonic()
            self.screen.show(view(run))

    def final(self, run: LocalRun | None) -> None:
        """The last view (and the end of a live region)."""
        self.screen.close(view(run) if run is not None and self.mode != "none" else None)
