"""What a local run's files and its syncer say: each island's step, losses, round and
rate (from its ``metrics.jsonl``), the merged rounds and refusals (from the syncer's
``tape.jsonl``), and each island's state as the syncer sees it (its Status).

`Progress` reads; `yeto.cli.local_run.LocalRun` owns the processes; the launcher's
display (`yeto.cli.launch_view`) shows what `Progress` holds.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from yeto.backends import BACKENDS
from yeto.io import JsonlFollower, finite_or_none
from yeto.loop import PROGRESS_FILE
from yeto.metrics import tape_scalars

ISLAND_SCALARS = ("train_loss", "eval_loss", "tokens_per_s", "loss_tokens")  # to TensorBoard


@dataclass
class IslandProc:
    """One island of the run: a local process, or a reserved slot (`external`) for an
    island on another machine, known only from the tape and the syncer's Status."""

    id: str
    backend: str
    dir: Path
    cmd: list[str]
    proc: subprocess.Popen | None = None
    metrics: JsonlFollower | None = None
    step: int = 0
    train_loss: float | None = None
    eval_loss: float | None = None
    eval_before: float | None = None
    version: int | None = None
    tokens_per_s: float | None = None
    done: dict | None = None          # the final summary record, once written
    code: int | None = None
    t_first: float | None = None      # wall time of its step-0 record (training starts)
    t_tokens: float | None = None     # wall time of the last merge that counted its tokens
    loss_tokens: int = 0              # merged loss tokens (from the tape)
    syncer_state: str = ""
    pushes: int = 0
    last_contact_s: float | None = None
    external: bool = False            # a reserved slot: an island on another machine

    @property
    def state(self) -> str:
        if self.code is not None:
            return "done" if self.code == 0 else f"failed ({self.code})"
        if self.external:
            return self.syncer_state or "waiting (external)"
        return self.syncer_state or "starting"


class Progress:
    """Follows the run's files: call `poll` now and then; read `merges`, `rejected`,
    `status`, `notes` and each `IslandProc`'s fields."""

    def __init__(self, out: Path, islands: list[IslandProc], report_to=()):
        self.out = out
        self.islands = islands            # the run's list (slots and islands are appended)
        self.tape = JsonlFollower(out / "syncer" / "tape.jsonl")
        self.merges: list[dict] = []
        self.rejected = 0
        self.status: dict = {}
        self.notes: list[str] = []        # lines for the display (islands joining)
        self.report_to = tuple(report_to)
        self._tb: dict = {}

    def track(self, name: str) -> None:
        """With --report-to tensorboard: a writer for `name` ("syncer" or an island id)."""
        if self.report_to:
            from yeto.metrics import MetricsWriter

            self._tb[name] = MetricsWriter(None, self.report_to,
                                           tb_dir=self.out / "tensorboard" / name)

    def poll(self, status: Callable[[], dict] | None = None
             ) -> tuple[list[dict], list[IslandProc]]:
        """Read what is new; returns (new merge/rejection records, islands that just
        exited). `status` fetches the syncer's Status (None: not this time)."""
        exited = self._read_islands()
        new = self.tape.read_new()
        for rec in new:
            if rec.get("event") == "merge":
                self._merge_record(rec)
            elif rec.get("event") == "rejected":
                self.rejected += 1
        if status is not None:
            self._read_status(status)
        return new, exited

    def _read_islands(self) -> list[IslandProc]:
        exited = []
        for isl in self.islands:
            if isl.external:  # its metrics are on its own machine
                continue
            for rec in isl.metrics.read_new():
                self._island_record(isl, rec)
            self._live(isl)
            if isl.code is None and isl.proc.poll() is not None:
                isl.code = isl.proc.returncode
                for rec in isl.metrics.read_new():
                    self._island_record(isl, rec)
                exited.append(isl)
        return exited

    @staticmethod
    def _live(isl: IslandProc) -> None:
        """The island's step and loss between its pushes (`yeto.loop.LiveProgress`)."""
        try:
            rec = json.loads((isl.dir / PROGRESS_FILE).read_text())
        except (OSError, ValueError):
            return  # not written yet (or not by this island's version)
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and \
                rec["step"] >= isl.step:  # newer than its last metrics line
            isl.step = rec["step"]
            if finite_or_none(rec.get("train_loss")) is not None:
                isl.train_loss = float(rec["train_loss"])

    def _merge_record(self, rec: dict) -> None:
        self.merges.append(rec)
        by_id = {i.id: i for i in self.islands}
        for r in rec.get("responders", []):
            isl = by_id.get(r.get("learner"))
            if isl is None:
                continue
            isl.pushes += 1
            # with --fragments P each fragment's pushes carry the tokens since that
            # fragment's last push: one fragment's pushes count each once
            if not rec.get("fragment"):
                isl.loss_tokens += int(r.get("tokens") or 0)
                isl.t_tokens = finite_or_none(rec.get("time")) or time.time()
                if isl.external:  # what the tape tells of an island on another machine
                    self._joined(isl, None)
                    _external_record(isl, rec, r)
        w = self._tb.get("syncer")
        if w is not None:
            for prefix, scalars in tape_scalars(rec).items():
                w.scalars(scalars, rec.get("round"), prefix=prefix)

    def _island_record(self, isl: IslandProc, rec: dict) -> None:
        if "eval_loss_before" in rec:  # the summary record written at the end
            isl.done = rec
        if rec.get("step") == 0 and isl.t_first is None:
            isl.t_first = finite_or_none(rec.get("time")) or time.time()
            isl.eval_before = finite_or_none(rec.get("eval_loss"))
        if isinstance(rec.get("step"), int):
            isl.step = max(isl.step, rec["step"])
        for k in ("train_loss", "eval_loss", "tokens_per_s"):
            if finite_or_none(rec.get(k)) is not None:
                setattr(isl, k, finite_or_none(rec[k]))
        if isinstance(rec.get("version"), int):
            isl.version = rec["version"]
        w = self._tb.get(isl.id)
        if w is not None and isinstance(rec.get("step"), int) and "eval_loss_before" not in rec:
            w.scalars({k: v for k, v in rec.items() if k in ISLAND_SCALARS}, rec["step"])

    def _read_status(self, fetch: Callable[[], dict]) -> None:
        try:
            self.status = fetch()
        except Exception:  # noqa: BLE001 - the display keeps its last view
            return
        by_id = {i["learner_id"]: i for i in self.status.get("islands", [])}
        for isl in self.islands:
            s = by_id.get(isl.id)
            if s is None or s["state"] == "reserved":  # a slot the syncer still waits for
                continue
            if isl.external:
                self._joined(isl, s.get("backend"))
            isl.syncer_state, isl.last_contact_s = s["state"], s.get("last_contact_s")

    def _joined(self, isl: IslandProc, backend: str | None) -> None:
        """An external island seen for the first time (in the Status or the tape)."""
        if backend and backend in BACKENDS:
            isl.backend = backend
        if isl.syncer_state:
            return
        isl.syncer_state = "training"
        isl.t_first = time.time()
        self.notes.append(f"{isl.id} joined from another machine ({isl.backend})")

    def rate(self, isl: IslandProc) -> float | None:
        """Loss tokens per second: the island's own figure when its metrics carry one,
        else the loss tokens merged from it over the time from its step 0 to its last
        merged push (waits for rounds included)."""
        if isl.tokens_per_s is not None:
            return isl.tokens_per_s
        if isl.t_first is None or isl.t_tokens is None or isl.t_tokens <= isl.t_first:
            return None
        return isl.loss_tokens / (isl.t_tokens - isl.t_first)

    def close(self) -> None:
        for w in self._tb.values():
            w.close()


def _external_record(isl: IslandProc, rec: dict, r: dict) -> None:
    """An external island's step, losses and round, from its responder entry."""
    isl.step += int(r.get("steps") or 0)
    isl.version = rec.get("round", isl.version)
    for k in ("train_loss", "eval_loss"):
        if finite_or_none(r.get(k)) is not None:
            setattr(isl, k, finite_or_none(r[k]))


def summarize(out: Path, seconds: float, external: list[str] = ()) -> dict:
    """summary.json of a local run (the format `yeto demo` has always written):
    held-out loss before/after (island-0's), rounds, bytes up/down, seconds, and
    per island its held-out loss, loss tokens and whether it got the final weights;
    per external slot, from the tape: merged pushes and loss tokens (its own outputs
    are on its machine). Bytes up and down are the launched islands' own counts summed
    (their summary.json: the seed, every push, every broadcast received, the final
    weights included), so they agree with the islands' files; the live view's merged
    pushes and broadcasts count only what the merges took and sent."""
    from syncer.tape import read_tape

    tape = out / "syncer" / "tape.jsonl"
    merges = [r for r in read_tape(tape) if r.get("event") == "merge"] if tape.exists() else []
    islands = {}
    for d in sorted((out / "islands").iterdir()) if (out / "islands").is_dir() else ():
        if (d / "summary.json").is_file():
            islands[d.name] = json.loads((d / "summary.json").read_text())
    first = next(iter(islands.values()), {})
    ext = {k: dict(pushes=0, loss_tokens=0) for k in external}
    for r in (x for m in merges for x in m.get("responders", []) if not m.get("fragment")):
        if r.get("learner") in ext:
            ext[r["learner"]]["pushes"] += 1
            ext[r["learner"]]["loss_tokens"] += int(r.get("tokens") or 0)
    return dict(eval_loss_before=finite_or_none(first.get("eval_loss_before")),
                eval_loss_after=finite_or_none(first.get("eval_loss")),
                rounds=len(merges),
                bytes_up=sum(int(v.get("bytes_up", 0)) for v in islands.values()),
                bytes_down=sum(int(v.get("bytes_down", 0)) for v in islands.values()),
                seconds=round(seconds, 1),
                islands={k: dict(eval_loss=finite_or_none(v.get("eval_loss")),
                                 loss_tokens=v.get("loss_tokens"),
                                 final=v.get("final")) for k, v in islands.items()},
                **(dict(external=ext) if ext else {}))
