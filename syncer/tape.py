"""The event tape: one JSON line per merge (and per rejected message), appended
and flushed as it happens so a crash loses at most the line being written."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from syncer.config import Config
    from syncer.pacing import OpenRound
    from syncer.strategy import Nesterov

log = logging.getLogger("syncer")


class Tape:
    # refused calls are taped at most REFUSALS_BURST at once per learner, then one every
    # REFUSALS_EVERY_S: a peer that hammers the syncer cannot fill its disk (the next
    # record it gets says how many were left out)
    REFUSALS_BURST, REFUSALS_EVERY_S = 20, 1.0

    def __init__(self, path: Path | None, clock: Callable[[], float] = time.monotonic):
        self.path, self.clock = path, clock
        self._refusals: dict[str, list[float]] = {}  # learner -> [allowance, last, left out]
        self._lock = threading.Lock()
        self._file: IO[bytes] | None = None
        self.lost = 0  # records the disk refused
        if path is not None:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._file = open(path, "ab", buffering=0)

    def write(self, record: dict[str, Any]) -> bool:
        """Append one record; False when the disk refused it (full, read-only, gone):
        the tape then loses that line, whole (never half a line), and says so in the
        log. The tape is the run's account, not its state: a commit never waits on it."""
        if self._file is None:
            return True
        line = (json.dumps(record, sort_keys=True, allow_nan=False, default=_plain)
                + "\n").encode()
        with self._lock:
            end = self._file.seek(0, os.SEEK_END)
            try:
                view = memoryview(line)
                while view:  # an unbuffered write may take part of it
                    view = view[self._file.write(view):]
                os.fsync(self._file.fileno())
                return True
            except OSError as e:
                self.lost += 1
                log.error("tape %s: could not write a %s record (%s); %d lost so far",
                          self.path, record.get("event", "?"), e, self.lost)
                with contextlib.suppress(OSError):
                    os.ftruncate(self._file.fileno(), end)  # no half line stays behind
                return False

    def refusal(self, learner: str, **fields: Any) -> bool:
        """Tape a refused call of `learner`, unless its allowance is spent (a token
        bucket per learner); what it leaves out is counted in the next record."""
        now = self.clock()
        with self._lock:
            if learner not in self._refusals and len(self._refusals) >= 10_000:
                self._refusals.clear()  # ids are checked, but many may come: stay bounded
            allowance, last, left_out = self._refusals.get(
                learner, [float(self.REFUSALS_BURST), now, 0])
            allowance = min(float(self.REFUSALS_BURST),
                            allowance + (now - last) / self.REFUSALS_EVERY_S)
            if allowance < 1:
                self._refusals[learner] = [allowance, now, left_out + 1]
                return False
            self._refusals[learner] = [allowance - 1, now, 0]
        extra = {"left_out_before": left_out} if left_out else {}
        return self.event("rejected", learner=learner, **fields, **extra)

    def event(self, event: str, **fields: Any) -> bool:
        """`write` a record of `event` with `fields` and the wall time."""
        return self.write(dict(event=event, **fields, time=time.time()))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def merge_record(rnd: OpenRound, reason: str, now: float, merge_s: float, version: int,
                 live: int, bytes_out: int, cfg: Config, outer: Nesterov, observers: list[str],
                 t: int = 1) -> dict[str, Any]:
    """The tape's record of a committed round (`rnd`: a `syncer.pacing.OpenRound`):
    each responder with the weight the merge really used and its share, and the outer
    step's (lr, μ) of this round (`t`: the fragment's outer step count)."""
    step_lr, step_mu, _ = outer.coefficients(t)
    capped = rnd.acc.share_scales  # islands the share cap lowered (syncer.bounds)
    for r in rnd.responders:  # the weights the merge really used (uniform fallback, cap)
        r["weight"] = rnd.acc.merged_weight(r["weight"]) * capped.get(r["learner"], 1.0)
    total_w = sum(r["weight"] for r in rnd.responders) or 1.0
    for r in rnd.responders:
        r["share"] = r["weight"] / total_w
    return dict(
        event="merge", round=version, fragment=rnd.fragment, version=version, reason=reason,
        responders=rnd.responders, quorum=cfg.quorum, islands_live=live,
        bytes_in=rnd.bytes_in, bytes_out=bytes_out, duplicates=rnd.duplicates,
        merge_seconds=merge_s, clip_scales=rnd.acc.clip_scales, share_scales=capped,
        center_scales=rnd.acc.center_scales,  # islands the centre bound pulled in
        center_ratio=max(rnd.acc.center_ratios.values(), default=None),  # the round's margin
        round_seconds=now - rnd.started_at, outer=cfg.outer, outer_lr=outer.lr,
        outer_momentum=outer.momentum, step_lr=step_lr, step_momentum=step_mu,
        merge_rule=cfg.merge,
        uniform_fallback=rnd.acc.uniform_fallback, time=time.time(), observers=observers)


def _plain(x: object) -> float | str:
    return float(x) if hasattr(x, "__float__") else str(x)


def read_tape(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
