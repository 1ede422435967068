"""The run: the outer loop's coordinator. It holds the lock and the shared model (Θ,
the outer momentum m, versions) and moves a push through the parts, in this order:

    join     syncer.members   (the ledger)        push    syncer.intake  (checks)
    merge    syncer.merge     (+ syncer.strategy)  pace    syncer.pacing  (when to commit)
    commit   syncer.persist   (state on disk)     publish syncer.broadcast

Transport-free: `syncer.service` turns gRPC messages into plain calls and dataclasses
(`syncer.messages`); every input is checked before it touches state, so a refused
call leaves the run exactly as it was. A round is committed once its state is on
disk; a crash never loses a version anyone has seen.

Zero loss tokens: a round whose pushes all carry 0 loss tokens merges them with
uniform weights (see `syncer.merge.MergeAccumulator`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from syncer import commit, finish, intake, members, persist, staging, state, strategy
from syncer.bounds import Bounds, NormBounds
from syncer.broadcast import Broadcast, Downlink
from syncer.errors import Reject
from syncer.members import LIVE, Member, Members
from syncer.merge import MergeAccumulator
from syncer.messages import PushHeader
from syncer.pacing import OpenRound, Pacing
from syncer.tape import Tape
from yeto.layout import Layout, TensorSpec

log = logging.getLogger("syncer")

__all__ = ["Config", "Member", "PushHeader", "Reject", "Run"]


MAX_QUORUM = 1 << 20  # islands a round may wait for (the wire carries it as uint32)


@dataclass
class Config:
    """The run's settings; the defaults are `python -m syncer`'s (its flags take them
    from here)."""

    quorum: int = 1
    rounds: int = 0
    # the outer rule: auto = nesterov-warmup 0.4/0.9 for SFT (plain averaging to Nesterov
    # 0.4/0.9 over the first 20 rounds), plain averaging once an RL island joins
    # (syncer.strategy.RegimeNesterov; BENCHMARKS.md, "One outer rule for every regime")
    outer: str = "auto"
    outer_lr: float = 0.4
    outer_momentum: float = 0.9
    merge: str = "mean"         # the merge rule (syncer.strategy.RULES)
    grace_ms: int = 500
    grace: str = "auto"         # auto: syncer.grace (grace_ms until measured); fixed
    round_timeout_s: float = 600.0
    max_staleness: int = 1
    clip_factor: float = 0.0
    downlink: str = "f32"
    fragments: int = 1
    state_dir: Path | None = None
    resume: bool = False
    expect_islands: tuple[str, ...] = ()  # reserved slots, listed as "reserved" until joined
    seed_from: str = ""  # the island whose initial weights seed Θ ("": the first to join)
    bounds: Bounds = field(default_factory=Bounds)  # what one island can do (syncer.bounds)
    # a commit whose state cannot be saved is retried this long; then the syncer stops
    save_timeout_s: float = 120.0
    # the run's secret (--token / $YETO_TOKEN): keys the state's digest (syncer.persist)
    token: str | None = field(default=None, repr=False)

    def check(self) -> None:
        """Refuse settings that would make the outer step non-finite or meaningless."""
        if not 1 <= self.quorum <= MAX_QUORUM:
            raise ValueError(f"--quorum must be 1 to {MAX_QUORUM}, got {self.quorum}")
        if not (np.isfinite(self.outer_lr) and self.outer_lr > 0):
            raise ValueError(f"--outer-lr must be a positive number, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")
        strategy.merge_rule(self.merge)
        strategy.outer_optimizer(self.outer, self.outer_lr, self.outer_momentum)
        self.bounds.check()


class Run:
    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic):
        config.check()
        self.cfg = config
        self.clock = clock  # seconds for grace windows and timeouts (yeto.sim: simulated)
        self.on_publish: Callable[[int, int], None] = lambda fragment, version: None
        self.run_id = uuid.uuid4().hex[:12]
        self.cond = threading.Condition()
        self.outer = strategy.outer_optimizer(config.outer, config.outer_lr,
                                              config.outer_momentum)
        self.rule = strategy.merge_rule(config.merge)
        self.tape = Tape(config.state_dir / "tape.jsonl" if config.state_dir else None)
        self.members = Members(config.bounds, clock)
        self.pacing = Pacing(config.quorum, config.grace, config.grace_ms, config.round_timeout_s)
        self.downlink = Downlink(config.downlink)
        self.layout: Layout | None = None
        self.weights_file, self.export_files = "weights.safetensors", {}
        self.theta: np.ndarray | None = None
        self.m: np.ndarray | None = None  # the outer momentum, kept only when it is used
        self.version, self.started, self.finished = 0, False, False
        # per fragment: its open round; the versions at which it committed; its outer
        # step count; its push norms (fragment f merges only f's slice of Θ)
        self.open: dict[int, OpenRound] = {}
        self.commits: dict[int, list[int]] = {}
        self.outer_steps: dict[int, int] = {}
        self.norms = NormBounds(config.bounds.norm_factor)
        self.seeder = config.seed_from  # who is asked for the seed (set at the first join)
        self.bytes_in = self.bytes_out = self.rejected = 0
        self.last_commit_at: float | None = None
        self.final_delivered: set[str] = set()
        self.pending = None  # a syncer.commit.PendingCommit: merged, not yet on disk
        self.problem = ""  # what keeps the run from committing, for status ("" if nothing)
        self.fatal: str | None = None  # why the run cannot go on: the syncer exits non-zero
        self.closing = False  # the syncer is stopping: nothing finishes the run now
        self.overlap_step = False  # syncer.stepping; serve() turns it on (not yeto.sim)
        if config.state_dir is not None:
            persist.restore_or_refuse(self, config.state_dir, config.resume)
        elif config.resume:
            raise state.StateError("--resume needs --state-dir (where the state was saved)")

    @property
    def momentum(self) -> np.ndarray | None:
        """The outer momentum m (zeros made on request when the run keeps none)."""
        return np.zeros_like(self.theta) if self.m is None and self.theta is not None else self.m

    # ---- join -------------------------------------------------------------------------
    def join(self, learner_id: str, specs: list[TensorSpec], fp: str, backend: str,
             weights_file: str, export_files: dict[str, str], observer: bool = False,
             tokens_per_step: int = 0, regime: str = "sft", sync_every: int = 0) -> dict:
        """An island joins; an `observer` (a rollout node) gets every Θ, never pushes or
        counts. `tokens_per_step`: its most loss tokens per step; `regime`: "sft" or "rl";
        `sync_every`: its steps between pushes of a fragment (0: a schedule by time)."""
        regime = members.checked_regime(learner_id, regime)
        layout = members.checked_layout(self.cfg, learner_id, specs, fp, backend)
        with self.cond:
            if self.finished:
                raise Reject("precondition", "this run has finished; start a new syncer")
            members.adopt_layout(self, learner_id, layout, weights_file, export_files,
                                 observer)
            kind = "observer" if observer else "training" if self.started else "waiting"
            member = self.members.enroll(learner_id, backend, kind, tokens_per_step,
                                         sync_every, self.version)
            member.fingerprint = layout.fingerprint
            if not (observer or self.seeder):
                self.seeder = learner_id  # one island seeds: no race between joiners
            live = len(self.members.live())
            log.info("%s joined (generation %d, %s%s): %d/%d islands", learner_id,
                     member.generation, backend, ", observer" if observer else "", live,
                     self.cfg.quorum)
            if observer:
                self.tape.event("observer", learner=learner_id, backend=backend,
                                version=self.version)
            else:
                for rnd in self.open.values():  # its pushes may make a round cappable
                    rnd.acc.expect(len(self.members.live()))
                if change := self.outer.note_island(learner_id, regime):  # a rule that follows it
                    self.tape.event("outer_rule", learner=learner_id, regime=regime,
                                    detail=change)
            self.maybe_start()
            return dict(run_id=self.run_id, generation=member.generation,
                        num_fragments=self.cfg.fragments,
                        send_seed=self.theta is None and learner_id == self.seeder,
                        quorum=self.cfg.quorum, joined=len(self.members.live()),
                        version=self.version, finished=self.finished,
                        last_seq=member.last_seq, downlink=self.cfg.downlink)

    def maybe_start(self) -> None:
        if self.started or self.theta is None or len(self.members.live()) < self.cfg.quorum:
            return
        self.started = True
        for member in self.members.live():
            member.state = "training"
        for f in range(self.cfg.fragments):
            self.open[f] = OpenRound(f, self.accumulator(f))
            self.commits.setdefault(f, [self.version])
            self.announce(self.downlink.next(self.theta, f, *self.span(f), final=False,
                                             version=self.fragment_version(f)))
        log.info("quorum of %d reached: round %d starts from version %d", self.cfg.quorum,
                 self.version + 1, self.version)

    def check_island(self, learner_id: str, generation: int) -> Member:
        """The caller's ledger row (call under `cond`); refuses unknown or stale callers."""
        return self.members.check(learner_id, generation)

    def heartbeat(self, learner_id: str, generation: int) -> dict:
        """The caller's view of the run: version, the open round (0 if none), finished."""
        with self.cond:
            self.check_island(learner_id, generation)
            return dict(version=self.version, round=self.open_round(), finished=self.finished)

    def open_round(self) -> int:
        """The round a push joins now: 0 before round 1 starts and after the run ends."""
        return self.version + 1 if self.started and not self.finished else 0

    # ---- push -------------------------------------------------------------------------
    def check_push_header(self, h: PushHeader) -> int:
        """Validate a push header before any payload is read; returns the payload size
        (`syncer.intake`)."""
        with self.cond:
            return intake.check_header(self, self.check_island(h.learner_id, h.generation), h)

    def push(self, h: PushHeader, payload, owned: bool = True) -> dict:
        """Seed Θ, or add a pseudo-gradient to the open round of its fragment. `owned`:
        the run may keep `payload` (False: a pooled buffer, copied if it must be kept)."""
        with self.cond:
            member = self.check_island(h.learner_id, h.generation)
            self.bytes_in += len(payload)
            if h.seed:
                return intake.seed(self, member, payload)
            staging.take_turn(self, h, payload)  # a whole push never waits for a stager
            intake.check_delta(self, h)
            rnd = self.open[h.fragment]
            if h.seq <= member.last_seq:
                rnd.duplicates += 1
                self._reject_note(h.learner_id, "duplicate", f"seq {h.seq} already received")
                return dict(accepted=False, status="duplicate", round=self.version + 1,
                            staleness=0)
            staleness = intake.staleness(self, h)
            intake.add_delta(self, member, rnd, h, payload, staleness, owned)
            self._maybe_commit(self.clock())
            return dict(accepted=True, status="accepted", round=self.version + 1,
                        staleness=staleness)

    def note_rejected(self, call: str, learner: str, reject: Reject) -> None:
        """Every refused call is counted and written to the tape."""
        with self.cond:
            self._reject_note(learner, f"{call}:{reject.code}", str(reject))

    def _reject_note(self, learner: str, kind: str, detail: str) -> None:
        self.rejected += 1
        self.tape.refusal(learner, kind=kind, detail=detail, round=self.version + 1)

    # ---- commit (syncer.commit) ---------------------------------------------------------
    def tick(self, now: float | None = None) -> None:
        """Called periodically: commits rounds whose grace or timeout has passed by
        `now` (default: the run's clock), and retries a save that failed."""
        with self.cond:
            now = self.clock() if now is None else now
            if self.pending is not None:
                commit.retry_save(self, now)
            elif self.started and not self.finished:
                self._maybe_commit(now)

    def _maybe_commit(self, now: float) -> None:
        live = self.members.live_ids()
        for rnd in list(self.open.values()):
            if rnd.responders and not (self.finished or self.pending or self.fatal):
                reason = self.pacing.reason(rnd, live, now)
                if reason:
                    commit.commit(self, rnd, reason, now)

    def next_deadline(self) -> float | None:
        """When the first open round commits by its grace window or its timeout if no
        push comes meanwhile (None: no round waits on time). `yeto.sim` jumps there."""
        with self.cond:
            if not self.started or self.finished:
                return None
            live = self.members.live_ids()
            return min((t for rnd in self.open.values() if rnd.responders
                        for t, _ in self.pacing.deadlines(rnd, live)), default=None)

    def fail(self, why: str) -> None:
        """The run cannot go on: `python -m syncer` exits non-zero with `why`."""
        with self.cond:
            log.critical("%s", why)
            self.fatal = why
            self.cond.notify_all()

    def span(self, f: int) -> tuple[int, int]:
        frag = self.layout.fragments[f]
        return frag.start, frag.stop

    def fragment_version(self, f: int) -> int:
        return self.commits[f][-1] if self.commits.get(f) else self.version

    def accumulator(self, f: int, reuse: np.ndarray | None = None) -> MergeAccumulator:
        bounds = self.cfg.bounds
        acc = MergeAccumulator(self.layout.fragments[f].numel, self.rule,
                               self.cfg.clip_factor, bounds.max_delta, bounds.share_cap)
        acc.expect(len(self.members.live()))  # more may join, or push: syncer.intake
        if reuse is not None:  # the last round's scratch
            acc.reuse(reuse)
        return acc

    def keeps_pushes(self, fragment: int) -> bool:
        """Whether a push to `fragment` is kept as received until its round commits
        (clipping, or a round that may be share-capped) instead of summed as it comes.
        Read without the lock: a push that finds another round at its end is copied."""
        rnd = self.open.get(fragment)
        return rnd.acc.keeps_pushes if rnd else self.cfg.clip_factor > 0 or self.rule.keeps_pushes

    def announce(self, broadcast: Broadcast) -> None:
        """Make `broadcast` its fragment's newest: the streams send it on, and
        `on_publish(fragment, version)` hears of it (`yeto.sim` holds its clock)."""
        self.downlink.latest[broadcast.fragment] = broadcast
        self.cond.notify_all()
        self.on_publish(broadcast.fragment, broadcast.version)

    # ---- finish -----------------------------------------------------------------------
    def finish_island(self, learner_id: str, generation: int) -> bool:
        with self.cond:
            member = self.check_island(learner_id, generation)
            if member.state == "observer":
                return self.finished  # an observer has no training to finish
            member.state = "finished"
            log.info("%s finished training", learner_id)
            finish.maybe_finish(self)
            return self.finished

    def island_gone(self, learner_id: str, generation: int) -> None:
        with self.cond:
            member = self.members.rows.get(learner_id)
            if member and member.generation == generation and \
                    (member.state in LIVE or member.state == "observer"):
                member.state = "gone"
                log.warning("%s disconnected", learner_id)
                if self.theta is None and self.seeder == learner_id and \
                        not self.cfg.seed_from:
                    self.seeder = ""  # the next island to join seeds Θ
                finish.maybe_finish(self)

    def close(self) -> None:
        """The syncer is stopping (a signal): islands that drop off now are leaving a
        server that goes away, not finishing the run."""
        with self.cond:
            self.closing = True

    def mark_final_delivered(self, learner_id: str) -> None:
        with self.cond:
            self.final_delivered.add(learner_id)

    def final_done(self) -> bool:
        """Every island that is still around has received the final weights."""
        with self.cond:
            waiting = {m.learner_id for m in self.members.rows.values() if m.state != "gone"}
            return waiting <= self.final_delivered

    # ---- status -----------------------------------------------------------------------
    def status(self) -> dict:
        with self.cond:
            now = self.clock()
            return dict(
                run_id=self.run_id, round=self.version + 1, problem=self.fatal or self.problem,
                version=self.version, quorum=self.cfg.quorum, finished=self.finished,
                bytes_in=self.bytes_in, bytes_out=self.bytes_out,
                last_merge_s=now - self.last_commit_at if self.last_commit_at else -1.0,
                islands=self.members.status(self.cfg.expect_islands))

    def state_digest(self) -> str:
        """SHA-256 over everything a rejected message must leave untouched."""
        with self.cond:
            return persist.digest(self)
