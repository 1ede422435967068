"""The run: the outer loop's coordinator. It holds the lock and the run's lifecycle
(started, finished, failed), and moves each call through the owners of the run's state:

    Members    syncer.members    the ledger of islands
    Model      syncer.model      the layout, Θ, the outer momentum and step counts
    Rounds     syncer.rounds     each fragment's open round, its sum and pacing
    Committer  syncer.commit     the version, each commit until its state is on disk
    Store      syncer.persist    the state dir (state file, final/)
    Downlink   syncer.broadcast  the newest broadcast per fragment
    Tape       syncer.tape       the event tape

One push: `SyncerService` -> `Run.push` -> `Members.check` -> `Rounds.add` ->
`Committer.commit` -> `Model.outer_step`, `Run.save_state` (`Store.save`) -> `Tape`,
`Downlink.publish`. Each owner's methods alone change its state.

Transport-free: `syncer.service` turns gRPC messages into plain calls and dataclasses
(`syncer.messages`); every input is checked before it touches state, so a refused
call leaves the run exactly as it was. A round is committed once its state is on
disk; a crash never loses a version anyone has seen.

Zero loss tokens: a round whose pushes all carry 0 loss tokens merges them with
uniform weights (see `syncer.merge.MergeAccumulator`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from syncer import intake, members, state, strategy
from syncer.broadcast import Broadcast, Downlink
from syncer.commit import Committer
from syncer.config import MAX_QUORUM, Config
from syncer.errors import Reject
from syncer.members import Member, Members
from syncer.messages import PushHeader
from syncer.model import Model
from syncer.pacing import Pacing
from syncer.persist import Store
from syncer.rounds import Rounds
from syncer.staging import Into, OwnedSeed, PushBody, Received, StagedSum
from syncer.standby import Standbys
from syncer.tape import Tape
from yeto import net
from yeto.codec.buffers import SpilledPayload
from yeto.layout import Layout, TensorSpec

log = logging.getLogger("syncer")

__all__ = ["MAX_QUORUM", "Config", "Member", "PushHeader", "Reject", "Run"]


class Run:
    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic,
                 tape: Tape | None = None):
        """`tape`: where the run's events go (default: tape.jsonl in the state dir, or
        nowhere without one)."""
        config.check()
        self.cfg = config
        self.clock = clock  # seconds for grace windows and timeouts (yeto.sim: simulated)
        self.on_publish: Callable[[int, int], None] = lambda fragment, version: None
        self.run_id = uuid.uuid4().hex[:12]
        self.term = 0  # raised by one at each standby takeover (`take_over`), saved with the state
        self.cond = threading.Condition()
        self.tape = tape or Tape(config.state_dir / "tape.jsonl" if config.state_dir else None)
        self.members = Members(config.bounds, clock)
        self.model = Model(config.fragments, strategy.outer_optimizer(
            config.outer, config.outer_lr, config.outer_momentum), config.seed_from)
        self.rounds = Rounds(strategy.merge_rule(config.merge), config.bounds,
                             config.clip_factor, config.max_staleness,
                             Pacing(config.quorum, config.grace, config.grace_ms,
                                    config.round_timeout_s), clock)
        self.downlink = Downlink(config.downlink)
        self.committer = Committer(config, self, self.cond, clock, self.model, self.rounds,
                                   self.members, self.downlink, self.tape)
        self.store = Store(config) if config.state_dir is not None else None
        self.standbys = Standbys(config.state_dir / state.STATE_FILE, config.token, self.tape,
                                 config.peer_tls) \
            if config.state_dir is not None else None
        self.started, self.finished = False, False
        self.bytes_in = self.bytes_out = self.rejected = 0
        self.final_delivered: set[str] = set()
        self._fatal: str | None = None  # why the run cannot go on: the syncer exits non-zero
        self.closing = False  # the syncer is stopping: nothing finishes the run now
        if self.store is not None:
            if config.resume:
                self._restore(self.store)
            else:
                self.store.refuse_existing()
        elif config.resume:
            raise state.StateError("--resume needs --state-dir (where the state was saved)")

    # ---- what others read -------------------------------------------------------------
    @property
    def fatal(self) -> str | None:
        return self._fatal

    @property
    def version(self) -> int:
        return self.committer.version

    @property
    def theta(self) -> np.ndarray | None:
        return self.model.theta

    @property
    def momentum(self) -> np.ndarray | None:
        return self.model.momentum

    @property
    def layout(self) -> Layout | None:
        return self.model.layout

    @property
    def weights_file(self) -> str:
        return self.model.weights_file

    @property
    def outer(self) -> strategy.Nesterov:
        return self.model.outer

    @property
    def problem(self) -> str:
        return self.committer.problem

    def overlap_steps(self) -> None:
        """From now on a commit without a state dir may step behind its broadcast
        (`syncer.stepping`); `syncer.service.serve` turns it on."""
        self.committer.overlap_steps()

    def _owners(self) -> list[int]:
        """The shard owning each fragment (`syncer.shards`; call once the layout is set)."""
        return self.cfg.shard.owners([self.model.numel(f) for f in range(self.cfg.fragments)])

    def owned(self) -> list[int]:
        """The fragments whose rounds this syncer runs (all of them, unsharded; none
        before the run has a layout)."""
        return [] if self.model.layout is None else self._owned_by(self.model.layout)

    def _owned_by(self, layout: Layout) -> list[int]:
        return self.cfg.shard.owns([frag.numel for frag in layout.fragments])

    def newest_broadcasts(self) -> list[Broadcast]:
        return self.downlink.newest()

    def holds_back(self) -> bool:
        """A merged Θ is not on disk yet: broadcasts wait (call under `cond`)."""
        return self.committer.holds_back

    def count_sent(self, nbytes: int) -> None:
        with self.cond:
            self.bytes_out += nbytes

    # ---- join -------------------------------------------------------------------------
    def join(self, learner_id: str, specs: list[TensorSpec], fp: str, backend: str,
             weights_file: str, export_files: dict[str, str], observer: bool = False,
             tokens_per_step: int = 0, regime: str = "sft", sync_every: int = 0,
             init_sha256: bytes = b"", known_term: int = 0,
             term_proof: bytes = b"") -> dict[str, Any]:
        """An island joins; an `observer` (a rollout node) gets every Θ, never pushes or
        counts. `tokens_per_step`: its most loss tokens per step; `regime`: "sft" or "rl";
        `sync_every`: its steps between pushes of a fragment (0: a schedule by time);
        `init_sha256`: the digest of its initial weights as a seed (b"": undeclared), which
        the first quorum compares before round 1 (`Model.vote`). `known_term`: the newest
        term the island heard of, with the run's signature of it (`term_proof`); a newer
        one than this syncer's, signed, fences it (`fence`)."""
        if known_term > self.term:
            self.fence(learner_id, known_term, term_proof)
        if len(init_sha256) not in (0, 32):
            raise Reject("invalid", f"{learner_id}: init_sha256 must be a SHA-256 digest "
                         f"(32 bytes), not {len(init_sha256)} bytes")
        regime = members.checked_regime(learner_id, regime)
        layout = members.checked_layout(self.cfg, learner_id, specs, fp, backend)
        with self.cond:
            if self.finished:
                raise Reject("precondition", "this run has finished; start a new syncer")
            if self.model.adopt(learner_id, layout, weights_file, export_files, observer):
                for lid in self.members.evict_observers(layout.fingerprint):
                    log.warning("observer %s joined with another model's layout; refused now "
                                "that %s brought the run's (%s)", lid, learner_id,
                                "start it with the islands' --model and LoRA settings")
            kind = "observer" if observer else "training" if self.started else "waiting"
            member = self.members.enroll(learner_id, backend, kind, tokens_per_step,
                                         sync_every, self.version, layout.fingerprint,
                                         b"" if observer else init_sha256)
            if not observer:
                self.model.choose_seeder(learner_id)  # one island seeds: no race
            live = len(self.members.live())
            log.info("%s joined (generation %d, %s%s): %d/%d islands", learner_id,
                     member.generation, backend, ", observer" if observer else "", live,
                     self.cfg.quorum)
            if observer:
                self.tape.event("observer", learner=learner_id, backend=backend,
                                version=self.version)
            else:
                self.rounds.expect(live)  # its pushes may make a round cappable
                if change := self.model.note_island(learner_id, regime):
                    self.tape.event("outer_rule", learner=learner_id, regime=regime,
                                    detail=change)
            self._maybe_start()
            return dict(run_id=self.run_id, generation=member.generation,
                        num_fragments=self.cfg.fragments,
                        send_seed=self.model.asks_seed_of(learner_id),
                        quorum=self.cfg.quorum, joined=len(self.members.live()),
                        version=self.version, finished=self.finished,
                        last_seq=member.last_seq, downlink=self.cfg.downlink,
                        shard=self.cfg.shard.index, shards=self.cfg.shard.count,
                        fragment_owner=self._owners() if self.cfg.shard.count > 1 and
                        self.model.layout is not None else [], term=self.term,
                        term_proof=self._term_proof(self.term))

    def _maybe_start(self) -> None:
        if self.started or self.model.theta is None or \
                len(self.members.live()) < self.cfg.quorum:
            return
        if change := self.model.vote(self.members.initial_weights()):
            log.warning("%s", change)
            self.tape.event("seed_vote", seeder=self.model.seeder, detail=change)
            self.cond.notify_all()  # the new seeder's broadcast stream asks it to join again
            return
        self.started = True
        self.members.start_training()
        self.rounds.start({f: self.model.numel(f) for f in self.owned()},
                          len(self.members.live()))
        self.committer.start()
        for f in self.owned():
            self.announce(self.downlink.next(self.model.the_theta, f, *self.model.span(f),
                                             final=False,
                                             version=self.committer.fragment_version(f)))
        log.info("quorum of %d reached: round %d starts from version %d", self.cfg.quorum,
                 self.version + 1, self.version)

    def check_island(self, learner_id: str, generation: int) -> Member:
        """The caller's ledger row (call under `cond`); refuses unknown or stale callers."""
        return self.members.check(learner_id, generation)

    def asks_seed_of(self, learner_id: str) -> bool:
        """Whether the run waits for `learner_id`'s initial weights as Θ (call under
        `cond`)."""
        return self.model.asks_seed_of(learner_id)

    def heartbeat(self, learner_id: str, generation: int) -> dict[str, Any]:
        """The caller's view of the run: version, the open round (0 if none), finished."""
        with self.cond:
            self.check_island(learner_id, generation)
            return dict(version=self.version, round=self.open_round(), finished=self.finished)

    def open_round(self) -> int:
        """The round a push joins now: 0 before round 1 starts and after the run ends."""
        return self.version + 1 if self.started and not self.finished else 0

    # ---- push -------------------------------------------------------------------------
    def push(self, h: PushHeader, body: PushBody) -> dict[str, Any]:
        """One push, whole: its header checked before any payload is read
        (`syncer.intake`), then its body received (a slot, a buffer, summed into its
        round as it arrives when it arrives alone: `syncer.staging`) and taken: Θ seeded
        or a pseudo-gradient added to the open round of its fragment. A round kept
        until its commit (clipping, a share cap: `Rounds.keeps_pushes`) keeps the
        payload as it came."""
        keep = self._check_push_header(h)
        with body.slot(), body.buffer(h, keep) as buf, body.arriving(h) as alone:
            staged = None
            into: Into = buf
            if h.seed:  # a shard keeps its own fragments of it only
                into = self.model.seed_target(self.owned())
            elif not keep and alone and buf is not None:
                staged = self._claim_staging(h, buf)
            elif not keep:  # beside others: it arrives whole, and a stager may too
                self._make_way(h)
            try:
                payload = body.receive(h, staged or into, intake.max_abs(h, self.cfg.bounds))
                return self._take(h, payload, owned=keep)
            finally:
                if staged is not None:
                    self._release_staging(staged)

    def _check_push_header(self, h: PushHeader) -> bool:
        """Validate a push header before any payload is read (`syncer.intake`); returns
        whether the run keeps the payload as it came (a seed; a round that keeps its
        pushes until the commit: `Rounds.keeps_pushes`)."""
        with self.cond:
            member = self.check_island(h.learner_id, h.generation)
            if member.state == "observer":
                raise Reject("precondition", f"{h.learner_id} joined as an observer: "
                             "observers receive Θ and never push")
            self.committer.check_saved()
            if self.model.layout is None:
                raise Reject("precondition", "no layout yet")
            if h.seed:
                intake.payload_size(h, self.model.numel())
                return True
            intake.payload_size(h, self.model.numel(intake.fragment(h, self.cfg.fragments)))
            intake.owner(h, self._owners(), self.cfg.shard.index)
            intake.round_open(h, self.started, self.finished, self.version)
            intake.claims(self.cfg.bounds, member, h, self.committer.commits_of(h.fragment),
                          self.clock())
            return self.rounds.keeps_pushes(h.fragment)

    def _take(self, h: PushHeader, payload: Received, owned: bool) -> dict[str, Any]:
        """Seed Θ, or add a pseudo-gradient to the open round of its fragment. `owned`:
        the run may keep `payload` (False: a pooled buffer, copied if it must be kept)."""
        with self.cond:
            member = self.check_island(h.learner_id, h.generation)
            self.bytes_in += len(payload)
            if h.seed:
                return self._seed(member, payload)
            if isinstance(payload, OwnedSeed):
                raise TypeError("only a seed arrives as an OwnedSeed")
            if self.finished:
                raise Reject("precondition", "the run has finished")
            self.committer.check_saved()
            intake.round_matches(h)
            staleness = self.rounds.take(member, h, payload, owned,
                                         self.committer.commits_of(h.fragment),
                                         self.members.live_ids(), self.version)
            if staleness is None:
                self._reject_note(h.learner_id, "duplicate", f"seq {h.seq} already received")
                return dict(accepted=False, status="duplicate", round=self.version + 1,
                            staleness=0)
            self._maybe_commit(self.clock())
            return dict(accepted=True, status="accepted", round=self.version + 1,
                        staleness=staleness)

    def _seed(self, member: Member, payload: Received) -> dict[str, Any]:
        if isinstance(payload, (SpilledPayload, StagedSum)):  # a seed never spills nor stages
            raise TypeError("a seed arrives whole in memory")
        try:
            if not self.model.seed(member.learner_id, payload, member.init_sha256,
                                   self.owned()):
                return dict(accepted=False, status="duplicate", round=0, staleness=0)
        except Reject as e:
            if self.model.seed_refused(member.learner_id, self.members.initial_weights()):
                self.tape.event("seed_refused", learner=member.learner_id,
                                seeder=self.model.seeder, detail=str(e))
                self.cond.notify_all()  # the next seeder's stream asks it to join again
            raise
        theta = self.model.the_theta
        self.rounds.seed_norms(theta, self.model.spans())
        self.tape.event("seeded", learner=member.learner_id, theta_sha256=state.digest(theta))
        self._maybe_start()
        return dict(accepted=True, status="accepted", round=0, staleness=0)

    # ---- staging: a push summed as it arrives (`syncer.staging`) ----------------------
    def _claim_staging(self, h: PushHeader, keep: SpilledPayload | np.ndarray
                       ) -> StagedSum | None:
        """A `StagedSum` for push `h` when it may stage into its round (`Rounds.claim`),
        else None. Not while a commit holds the lock (its save may take a while: this
        push arrives whole instead of waiting)."""
        if h.seed or not self.cond.acquire(blocking=False):
            return None
        try:
            if self.committer.busy or self.finished or self._fatal:
                return None
            return self.rounds.claim(h, keep)
        finally:
            self.cond.release()

    def _make_way(self, h: PushHeader) -> None:
        """Push `h` starts beside others (`Rounds.make_way`); skipped while a commit
        holds the lock (nobody waits here)."""
        if h.seed or not self.cond.acquire(blocking=False):
            return
        try:
            self.rounds.make_way(h)
        finally:
            self.cond.release()

    def _release_staging(self, staged: StagedSum) -> None:
        """The staged push's stream is over. (Folded or taken over, it is already: then
        the lock is not waited for.)"""
        if staged.acc.staging is not staged:
            return
        with self.cond:
            self.rounds.release(staged)

    def note_rejected(self, call: str, learner: str, reject: Reject) -> None:
        """Every refused call is counted and written to the tape."""
        with self.cond:
            self._reject_note(learner, f"{call}:{reject.code}", str(reject))

    def _reject_note(self, learner: str, kind: str, detail: str) -> None:
        self.rejected += 1
        self.tape.refusal(learner, kind=kind, detail=detail, round=self.version + 1)

    # ---- commit (`syncer.commit`) -----------------------------------------------------
    def tick(self, now: float | None = None) -> None:
        """Called periodically: commits rounds whose grace or timeout has passed by
        `now` (default: the run's clock), and retries a save that failed."""
        with self.cond:
            now = self.clock() if now is None else now
            if self.committer.busy:
                self.committer.retry(now)
            elif self.started and not self.finished:
                self._maybe_commit(now)

    def _maybe_commit(self, now: float) -> None:
        for rnd, reason in self.rounds.due(self.members.live_ids(), now):
            if self.finished or self.committer.busy or self._fatal:
                return
            self.committer.commit(rnd, reason, now)

    def next_deadline(self) -> float | None:
        """When the first open round commits by its grace window or its timeout if no
        push comes meanwhile (None: no round waits on time). `yeto.sim` jumps there."""
        with self.cond:
            if not self.started or self.finished:
                return None
            return self.rounds.next_deadline(self.members.live_ids())

    def take_over(self, primary: str) -> None:
        """This syncer, a standby of `primary`, takes the run over: its term is the
        primary's plus one, on disk before any island is served (an island that joins it
        carries the new term to the old primary, should that one still answer: `fence`),
        and on the tape."""
        with self.cond:
            self.term += 1
            newest = max(range(self.cfg.fragments), key=self.committer.fragment_version)
            self.save_state(self.version, newest)
            self.tape.event("takeover", primary=primary, version=self.version, term=self.term)
            log.warning("took the run over from %s at version %d (term %d)", primary,
                        self.version, self.term)

    def _term_proof(self, term: int) -> bytes:
        """The run's signature of `term` (b"" at term 0, or without a run secret)."""
        return net.term_proof(self.cfg.token, self.run_id, term) if term and self.cfg.token \
            else b""

    def fence(self, learner_id: str, term: int, proof: bytes) -> NoReturn:
        """`learner_id` joined carrying `term`, newer than this syncer's: a standby took
        the run over while this syncer was cut off or frozen. This syncer stops (it exits
        non-zero, committing nothing more) and refuses the join as unavailable, so the
        island moves on to the next address it holds. With a run secret the term must
        carry the run's signature (`yeto.net.term_proof`): a term an island made up is
        refused and taped, and fences nothing."""
        if self.cfg.token and not hmac.compare_digest(proof, self._term_proof(term)):
            raise Reject("invalid", f"{learner_id} claims term {term} without the run's "
                         "signature of it: a term only a syncer that took the run over "
                         "can hand out")
        why = (f"fenced: {learner_id} knows term {term}, newer than this syncer's "
               f"({self.term}): a standby took the run over while this syncer was cut off "
               f"or frozen; its state dir is stale (the run goes on at the standby)")
        self.tape.event("fenced", learner=learner_id, term=term, own_term=self.term,
                        version=self.version)
        self.fail(why)
        raise Reject("unavailable", why)

    def fail(self, why: str) -> None:
        """The run cannot go on: `python -m syncer` exits non-zero with `why`."""
        with self.cond:
            log.critical("%s", why)
            self._fatal = why
            self.cond.notify_all()

    def announce(self, broadcast: Broadcast) -> None:
        """Make `broadcast` its fragment's newest: the streams send it on, and
        `on_publish(fragment, version)` hears of it (`yeto.sim` holds its clock)."""
        self.downlink.publish(broadcast)
        self.cond.notify_all()
        self.on_publish(broadcast.fragment, broadcast.version)

    def save_state(self, version: int, fragment: int) -> None:
        """The state as of `version`, committed by `fragment`'s round (raises OSError)."""
        if self.store is None:
            return
        self.store.save(self.model.the_theta, self.model.m, self.downlink.island_theta, dict(
            run_id=self.run_id, version=version, round=version, term=self.term,
            shard=[self.cfg.shard.index, self.cfg.shard.count],
            fragment_versions=self.committer.fragment_versions(fragment, version),
            norm_history=self.rounds.norm_record(), bytes_in=self.bytes_in,
            bytes_out=self.bytes_out, islands=self.members.ledger(), **self.model.record()))
        if self.standbys is not None:  # before the round is published: a standby has it
            self.standbys.replicate(version)

    def register_standby(self, address: str, version: int) -> dict[str, Any]:
        """A standby syncer at `address` (holding `version`) is there (`syncer.standby`)."""
        if self.standbys is None:
            raise Reject("precondition", "this syncer has no --state-dir: a standby needs "
                         "the states it saves")
        self.standbys.register(address, version, self.version, self.finished)
        return dict(run_id=self.run_id, version=self.version, finished=self.finished)

    def standbys_told(self) -> bool:
        """Every standby has heard that the run finished (so none takes it over)."""
        return self.standbys is None or self.standbys.all_told()

    def committed(self, last: bool) -> None:
        """A round's state is on disk and published; `last`: the run's last round."""
        if last:
            self._final_broadcasts()
            self._finish()
        else:
            self._maybe_finish()  # islands that finished while the save waited

    # ---- finish -----------------------------------------------------------------------
    def finish_island(self, learner_id: str, generation: int) -> bool:
        with self.cond:
            member = self.check_island(learner_id, generation)
            if member.state == "observer":
                return self.finished  # an observer has no training to finish
            self.members.finished(learner_id)
            log.info("%s finished training", learner_id)
            self._maybe_finish()
            return self.finished

    def island_gone(self, learner_id: str, generation: int) -> None:
        with self.cond:
            if self.members.gone(learner_id, generation):
                log.warning("%s disconnected", learner_id)
                self.model.seeder_gone(learner_id)
                self._maybe_finish()

    def _maybe_finish(self) -> None:
        """Finish the run once no island trains and one has finished (committing what
        the open rounds hold first); everyone vanished: keep Θ, wait for them."""
        if self.finished or not self.started or self.members.live() or self.closing:
            return
        if not self.members.in_state("finished"):
            return
        for rnd in self.rounds.with_pushes():
            if self.finished or self.committer.busy:
                break
            self.committer.commit(rnd, "finish", self.clock())
        if not self.finished and not self.committer.busy and not self._fatal:
            self._final_broadcasts()
            self._finish()

    def _final_broadcasts(self) -> None:
        """Every fragment's final weights (this shard's), exact, in f32."""
        for f in self.owned():
            self.announce(self.downlink.next(self.model.the_theta, f, *self.model.span(f),
                                             final=True,
                                             version=self.committer.fragment_version(f)))

    def _finish(self) -> None:
        """The run is over: final/ is written (a failure to write it fails the run)."""
        self.finished = True
        self.cond.notify_all()
        if self.store is not None and self.cfg.shard.count > 1:
            log.info("shard %d/%d finished at version %d: its state holds its fragments; "
                     "`yeto export` with every shard's --state-dir assembles the run's "
                     "weights", self.cfg.shard.index, self.cfg.shard.count, self.version)
        elif self.store is not None:
            try:
                self.store.write_final(self.model.the_layout, self.model.the_theta,
                                       self.model.weights_file, self.model.export_files,
                                       self.version, self.run_record())
            except OSError as e:
                self.fail(f"cannot write the final weights to {self.cfg.state_dir}: {e}. "
                          f"The state holds them (version {self.version}): free space and "
                          "restart the syncer with --resume")
                return
            except Exception as e:  # noqa: BLE001 - what an island sent cannot make final/
                self.fail(f"cannot build the final weights from what the islands sent "
                          f"({e!r}); the state holds Θ at version {self.version}: `yeto "
                          "export` writes it in another format")
                return
        log.info("run finished at version %d", self.version)

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

    # ---- on disk ----------------------------------------------------------------------
    def _restore(self, store: Store) -> None:
        saved = store.load()
        meta = saved.meta
        self.model.restore(saved.model, self._owned_by(saved.model.layout))
        self.committer.restore(meta["version"], saved.fragment_versions)
        self.downlink.restore(saved.island_theta)
        self.rounds.restore_norms(meta.get("norm_history", {}), saved.model.theta,
                                  self.model.spans())
        self.members.restore(meta["islands"])
        self.run_id = meta["run_id"]
        self.term = int(meta.get("term", 0))  # (states before terms: 0)
        self.bytes_in, self.bytes_out = meta["bytes_in"], meta["bytes_out"]
        log.info("resumed run %s at version %d (%d islands in the ledger)", self.run_id,
                 self.version, len(self.members.rows))
        self.tape.write(dict(event="resumed", version=self.version, time=time.time()))

    def run_record(self) -> dict[str, Any]:
        """What the final weights are: for provenance.json."""
        return dict(run_id=self.run_id, version=self.version, **self.model.provenance(),
                    islands=self.members.ledger())

    # ---- status -----------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        with self.cond:
            now = self.clock()
            last = self.committer.last_commit_at
            return dict(
                run_id=self.run_id, round=self.version + 1,
                problem=self._fatal or self.committer.problem,
                version=self.version, quorum=self.cfg.quorum, finished=self.finished,
                bytes_in=self.bytes_in, bytes_out=self.bytes_out,
                last_merge_s=now - last if last else -1.0,
                shard=self.cfg.shard.index, shards=self.cfg.shard.count,
                islands=self.members.status(self.cfg.expect_islands))

    def overview(self) -> dict[str, Any]:
        """`status` and what the dashboard shows beside it: started, calls refused, the
        config (not its secrets: the fields it keeps out of its repr, the run's token and
        the TLS key), and the model's size once it has a layout."""
        out = self.status()
        with self.cond:
            out.update(started=self.started, rejected=self.rejected,
                       config={k: (str(v) if isinstance(v, Path) else v)
                               for k, v in self.cfg.public().items()})
            if self.model.layout is not None:
                out.update(parameters=int(self.model.layout.numel),
                           tensors=len(self.model.layout.specs))
        return out

    def state_digest(self) -> str:
        """SHA-256 over everything a rejected message must leave untouched."""
        with self.cond:
            h = hashlib.sha256(f"{self.version}|{self.started}|{self.finished}".encode())
            self.model.digest_into(h)
            self.rounds.digest_into(h)
            h.update(repr(self.members.digest_parts()).encode())
            return h.hexdigest()

