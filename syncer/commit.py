"""A round's commit: merge and outer step, then the state on disk, then the tape and
the broadcast, in that order, so a crash never loses a version anyone has seen.

`Committer` owns the run's version, the versions at which each fragment committed, and
the commit in progress (`PendingCommit`). A commit is a commit once its state is on
disk. Until the save succeeds (a full or failing disk) the version does not advance,
nobody sees it, pushes wait (`check_saved`), status says why, and the save is retried on
the ticker; after `save_timeout_s` the run fails (the syncer exits non-zero, the disk
holds the last committed round for --resume).

Without a state dir the outer step may run behind the broadcast (`syncer.stepping`).
Callers hold the run's lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from syncer import stepping
from syncer.broadcast import Broadcast, Downlink
from syncer.config import Config
from syncer.errors import Reject
from syncer.members import Members
from syncer.merge import NonFinite
from syncer.model import Model
from syncer.pacing import OpenRound
from syncer.rounds import Rounds
from syncer.tape import Tape, merge_record

log = logging.getLogger("syncer")


class Host(Protocol):
    """What a commit asks of the run that holds it (`syncer.run.Run`)."""

    @property
    def fatal(self) -> str | None: ...
    def fail(self, why: str) -> None: ...
    def announce(self, broadcast: Broadcast) -> None: ...
    def save_state(self, version: int, fragment: int) -> None: ...
    def committed(self, last: bool) -> None: ...


@dataclass
class PendingCommit:
    """A round merged into Θ in memory whose state is not on disk yet: what publishing
    it needs once the save succeeds."""

    rnd: OpenRound
    reason: str
    now: float
    merge_s: float
    g: np.ndarray | None  # the round's sum buffer, scratch for the next round
    done: bool
    broadcast: Broadcast
    first_try: float
    next_try: float = 0.0
    tries: int = 0
    stepping: bool = False  # its step, behind its broadcast, is still running

    @property
    def streamed(self) -> bool:
        """Announced before its step (`syncer.stepping`)."""
        return self.broadcast.source.filling is not None

    def stepped(self, g: np.ndarray | None, merge_s: float) -> None:
        """Its step behind the broadcast has ended."""
        self.g, self.merge_s, self.stepping = g, merge_s, False

    def failed_save(self, now: float) -> None:
        """A save failed at `now`: the next try waits longer each time (up to 5 s)."""
        self.next_try = now + min(5.0, 0.5 * 2 ** self.tries)
        self.tries += 1


class Committer:
    """Commits rounds into Θ, one at a time, in the order above."""

    def __init__(self, cfg: Config, host: Host, cond: threading.Condition,
                 clock: Callable[[], float], model: Model, rounds: Rounds, members: Members,
                 downlink: Downlink, tape: Tape):
        self.cfg, self.host, self.cond, self.clock = cfg, host, cond, clock
        self.model, self.rounds, self.members = model, rounds, members
        self.downlink, self.tape = downlink, tape
        self.version = 0
        self.history: dict[int, list[int]] = {}  # per fragment: versions it committed at
        self.pending: PendingCommit | None = None
        self.problem = ""  # what keeps the run from committing ("" if nothing)
        self.last_commit_at: float | None = None
        self.overlap_step = False  # `syncer.stepping`; `serve` turns it on (not yeto.sim)

    def overlap_steps(self) -> None:
        """A commit without a state dir may step behind its broadcast from now on."""
        self.overlap_step = True

    # ---- versions -------------------------------------------------------------------
    def start(self) -> None:
        """Round 1 opens: each fragment's history starts at the version Θ holds."""
        for f in range(self.cfg.fragments):
            self.history.setdefault(f, [self.version])

    def restore(self, version: int, fragment_versions: list[int]) -> None:
        self.version = version
        self.history = {f: [v] for f, v in enumerate(fragment_versions)}

    def commits_of(self, f: int) -> list[int]:
        return self.history.get(f, [])

    def fragment_version(self, f: int) -> int:
        return self.history[f][-1] if self.history.get(f) else self.version

    def fragment_versions(self, fragment: int, version: int) -> list[int]:
        """Each fragment's version once `fragment` commits `version`."""
        return [version if f == fragment else self.fragment_version(f)
                for f in range(self.cfg.fragments)]

    # ---- state of the commit in progress ---------------------------------------------
    @property
    def busy(self) -> bool:
        """A commit is in progress (merged, not yet on disk or not yet stepped)."""
        return self.pending is not None

    @property
    def holds_back(self) -> bool:
        """A merged Θ is not on disk yet: broadcast streams wait (a streamed commit's
        broadcast is out already)."""
        return self.pending is not None and not self.pending.streamed

    def check_saved(self) -> None:
        """Refuse pushes while a commit waits for its state to reach the disk; wait (up
        to `syncer.stepping.WAIT_S`) while an outer step runs behind its broadcast."""
        if self.pending is not None and self.pending.stepping:
            self.cond.wait_for(lambda: self.pending is None or not self.pending.stepping
                               or bool(self.host.fatal), timeout=stepping.WAIT_S)
        if self.host.fatal:
            raise Reject("precondition", f"the syncer is stopping: {self.host.fatal}")
        if self.pending is not None:
            why = "to finish the outer step of" if self.pending.stepping else "to save"
            problem = f": {self.problem}" if self.problem else ""
            raise Reject("exhausted", f"the syncer is waiting {why} round "
                         f"{self.version + 1}{problem}; the island retries")

    # ---- the commit -----------------------------------------------------------------
    def commit(self, rnd: OpenRound, reason: str, now: float) -> None:
        """Merge `rnd` into Θ (in memory) and save; see the module's docstring."""
        t0 = time.perf_counter()
        f = rnd.fragment
        self.downlink.detach(f)  # Θ changes below: streams of the old version keep it
        if rnd.acc.uniform_fallback:
            log.warning("round %d: every push carried 0 loss tokens; merged with uniform "
                        "weights", self.version + 1)
        version = self.version + 1
        done = bool(self.cfg.rounds and version >= self.cfg.rounds)
        if self._behind(done):
            self._streamed(rnd, reason, now, version, t0)
            return
        try:
            g, t = self.model.outer_step(f, rnd.acc)
        except NonFinite as e:
            self._non_finite(e)
            return
        self.model.stepped(f, t)
        broadcast = self.downlink.next(self.model.the_theta, f, *self.model.span(f),
                                       final=done, version=version)
        self.pending = PendingCommit(rnd, reason, now, time.perf_counter() - t0, g, done,
                                     broadcast, first_try=now)
        self.retry(now)

    def _behind(self, final: bool) -> bool:
        """Whether this commit's step may run behind its broadcast."""
        return (self.overlap_step and self.cfg.state_dir is None and not final
                and self.cfg.downlink == "f32")

    def _streamed(self, rnd: OpenRound, reason: str, now: float, version: int,
                  t0: float) -> None:
        """Announce fragment f's new version, then step it behind the broadcast
        (`syncer.stepping`); the commit completes when the step ends."""
        f = rnd.fragment
        broadcast = self.downlink.next(self.model.the_theta, f, *self.model.span(f),
                                       final=False, version=version, filling=True)
        p = self.pending = PendingCommit(rnd, reason, now, 0.0, None, False, broadcast,
                                         first_try=now, stepping=True)
        self.host.announce(broadcast)
        filling = broadcast.source.filling
        assert filling is not None
        stepping.start(f, filling, self.cond,
                       step=lambda on_chunk: self.model.outer_step(f, rnd.acc, on_chunk),
                       stepped=lambda out: self._stepped(p, out, t0),
                       failed=self._non_finite, fail=self.host.fail)

    def _stepped(self, p: PendingCommit, out: tuple[np.ndarray | None, int],
                 t0: float) -> None:
        """The step behind a streamed commit has ended (under the run's lock)."""
        g, t = out
        self.model.stepped(p.rnd.fragment, t)
        p.stepped(g, time.perf_counter() - t0)
        self.retry(self.clock())

    def _non_finite(self, e: NonFinite) -> None:
        fix = ("Restart the syncer with --resume (the state on disk is the last committed "
               "round)" if self.cfg.state_dir else "The run cannot go on (no --state-dir to "
               "resume from)")
        self.host.fail(f"round {self.version + 1}: {e}; Θ in memory is not the last "
                       f"committed one. {fix}")

    def retry(self, now: float) -> None:
        """Save the pending commit's state; on success the version is committed and
        published, else the run says why and tries again later."""
        p = self.pending
        if p is None or p.stepping or now < p.next_try:
            return
        try:
            self.host.save_state(self.version + 1, p.rnd.fragment)
        except OSError as e:
            self._save_failed(p, e, now)
            return
        self.pending, self.problem = None, ""
        self._committed(p)

    def _save_failed(self, p: PendingCommit, e: OSError, now: float) -> None:
        first = not self.problem
        self.problem = f"cannot save the state to {self.cfg.state_dir}: {e}"
        p.failed_save(now)
        if first:
            log.error("round %d is not committed: %s; retrying for %.0f s (pushes wait)",
                      self.version + 1, self.problem, self.cfg.save_timeout_s)
            self.tape.write(dict(event="save_failed", round=self.version + 1, detail=str(e),
                                 time=time.time()))
        if now - p.first_try >= self.cfg.save_timeout_s:
            self.host.fail(f"{self.problem} (for {self.cfg.save_timeout_s:.0f} s). The state "
                           f"on disk is round {self.version}'s: free space (or fix the disk) "
                           "and restart the syncer with --resume")

    def _committed(self, p: PendingCommit) -> None:
        """A commit whose state is on disk: version, next round, tape, broadcast."""
        rnd, f = p.rnd, p.rnd.fragment
        self.version += 1
        self.history[f].append(self.version)
        live = len(self.members.live())
        self.rounds.reopen(f, self.model.numel(f), live, p.g)
        self.last_commit_at = p.now
        self.tape.write(merge_record(rnd, p.reason, p.now, p.merge_s, self.version, live,
                                     p.broadcast.nbytes * live, self.cfg, self.model.outer,
                                     self.members.in_state("observer"), self.model.steps(f)))
        if p.streamed:  # announced at the commit: its last byte may go now
            filling = p.broadcast.source.filling
            assert filling is not None
            filling.complete()
            self.cond.notify_all()  # pushes wait for the step (`check_saved`)
        else:
            self.host.announce(p.broadcast)
        log.info("round %d (fragment %d) committed (%s): %d pushes from %s", self.version, f,
                 p.reason, len(rnd.responders), ",".join(sorted(rnd.learners)))
        for lid in sorted(rnd.acc.center_scales):
            log.warning("round %d (fragment %d): %s's push was %.3g× the others' typical "
                        "distance from the round's median; pulled in to %g× "
                        "(--center-factor)", self.version, f, lid,
                        rnd.acc.center_ratios.get(lid, 0.0), self.cfg.bounds.center_factor)
        self.host.committed(p.done)

