"""A round's commit: merge and outer step, then the state on disk, then the tape and
the broadcast, in that order, so a crash never loses a version anyone has seen.

Without a state dir the outer step may run behind the broadcast (`syncer.stepping`).

A commit is a commit once its state is on disk. Until the save succeeds (a full or
failing disk) the version does not advance, nobody sees it, pushes wait
(`syncer.intake.check_saved`), status says why, and the save is retried on the ticker; after
`save_timeout_s` the run fails (`Run.fail`: the syncer exits non-zero, the disk
holds the last committed round for --resume). Callers hold the run's lock.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from syncer import finish, persist, stepping
from syncer.broadcast import Broadcast
from syncer.merge import NonFinite
from syncer.pacing import OpenRound
from syncer.tape import merge_record

log = logging.getLogger("syncer")


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


def commit(run, rnd: OpenRound, reason: str, now: float) -> None:
    """Merge `rnd` into Θ (in memory) and save; see the module's docstring."""
    t0 = time.perf_counter()
    f = rnd.fragment
    lo, hi = run.span(f)
    run.downlink.detach(f)  # Θ changes below: streams of the old version keep it
    m = None if run.m is None else run.m[lo:hi]
    t = run.outer_steps.get(f, 0) + 1
    if rnd.acc.uniform_fallback:
        log.warning("round %d: every push carried 0 loss tokens; merged with uniform "
                    "weights", run.version + 1)
    version = run.version + 1
    done = bool(run.cfg.rounds and version >= run.cfg.rounds)
    if stepping.behind(run, done):
        _streamed(run, rnd, reason, now, version, m, t, t0)
        return
    try:
        g = rnd.acc.step_outer(run.outer, run.theta[lo:hi], m, t)
    except NonFinite as e:
        non_finite(run, e)
        return
    run.outer_steps[f] = t
    broadcast = run.downlink.next(run.theta, f, lo, hi, final=done, version=version)
    run.pending = PendingCommit(rnd, reason, now, time.perf_counter() - t0, g, done,
                                broadcast, first_try=now)
    retry_save(run, now)


def _streamed(run, rnd: OpenRound, reason: str, now: float, version: int, m, t: int,
              t0: float) -> None:
    """Announce fragment f's new version, then step it behind the broadcast
    (`syncer.stepping`); the commit completes when the step ends."""
    f = rnd.fragment
    lo, hi = run.span(f)
    broadcast = run.downlink.next(run.theta, f, lo, hi, final=False, version=version,
                                  filling=True)
    p = run.pending = PendingCommit(rnd, reason, now, 0.0, None, False, broadcast,
                                    first_try=now, stepping=True)
    run.announce(broadcast)
    stepping.start(run, f, broadcast.source.filling,
                   step=lambda on_chunk: rnd.acc.step_outer(
                       run.outer, run.theta[lo:hi], m, t, on_chunk=on_chunk),
                   stepped=lambda g: _stepped(run, p, g, t, t0),
                   failed=lambda e: non_finite(run, e))


def _stepped(run, p: PendingCommit, g: np.ndarray, t: int, t0: float) -> None:
    """The step behind a streamed commit has ended (under the run's lock)."""
    run.outer_steps[p.rnd.fragment] = t
    p.g, p.merge_s, p.stepping = g, time.perf_counter() - t0, False
    retry_save(run, run.clock())


def non_finite(run, e: NonFinite) -> None:
    fix = ("Restart the syncer with --resume (the state on disk is the last committed "
           "round)" if run.cfg.state_dir else "The run cannot go on (no --state-dir to "
           "resume from)")
    run.fail(f"round {run.version + 1}: {e}; Θ in memory is not the last committed "
             f"one. {fix}")


def retry_save(run, now: float) -> None:
    """Save the pending commit's state; on success the version is committed and
    published, else the run says why and tries again later."""
    p = run.pending
    if p.stepping or now < p.next_try:
        return
    try:
        persist.save(run, run.version + 1, p.rnd.fragment)
    except OSError as e:
        _save_failed(run, p, e, now)
        return
    run.pending, run.problem = None, ""
    _committed(run, p)
    finish.maybe_finish(run)  # islands that finished while the save waited


def _save_failed(run, p, e: OSError, now: float) -> None:
    first = not run.problem
    run.problem = f"cannot save the state to {run.cfg.state_dir}: {e}"
    p.next_try = now + min(5.0, 0.5 * 2 ** p.tries)
    p.tries += 1
    if first:
        log.error("round %d is not committed: %s; retrying for %.0f s (pushes wait)",
                  run.version + 1, run.problem, run.cfg.save_timeout_s)
        run.tape.write(dict(event="save_failed", round=run.version + 1, detail=str(e),
                            time=time.time()))
    if now - p.first_try >= run.cfg.save_timeout_s:
        run.fail(f"{run.problem} (for {run.cfg.save_timeout_s:.0f} s). The state on disk is "
                 f"round {run.version}'s: free space (or fix the disk) and restart the "
                 "syncer with --resume")


def _committed(run, p) -> None:
    """A commit whose state is on disk: version, next round, tape, broadcast."""
    rnd, f = p.rnd, p.rnd.fragment
    run.version += 1
    run.commits[f].append(run.version)
    run.open[f] = OpenRound(f, run.accumulator(f, reuse=p.g))
    run.last_commit_at = p.now
    live = len(run.members.live())
    run.tape.write(merge_record(rnd, p.reason, p.now, p.merge_s, run.version, live,
                                p.broadcast.nbytes * live, run.cfg, run.outer,
                                run.members.in_state("observer"), run.outer_steps[f]))
    if p.streamed:  # announced at the commit: its last byte may go now
        p.broadcast.source.filling.complete()
        run.cond.notify_all()  # pushes wait for the step (syncer.intake.check_saved)
    else:
        run.announce(p.broadcast)
    log.info("round %d (fragment %d) committed (%s): %d pushes from %s", run.version, f,
             p.reason, len(rnd.responders), ",".join(sorted(rnd.learners)))
    if p.done:
        finish.final_broadcasts(run)
        finish.finish(run)
