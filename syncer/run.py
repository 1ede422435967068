"""Rounds: the outer loop's state machine (members, Θ and momentum, the open rounds).

Transport-free: the gRPC service (`syncer.service`) validates wire framing and
calls in here; all state changes happen under one lock, and every input is
checked before it touches state (a rejected call leaves the run exactly as it was).
Reading order: join -> push -> commit (merge, outer step) -> broadcast -> finish ->
state on disk -> status.

Rules worth knowing:
- Round r is open on base version r-1. It commits when K = quorum distinct
  islands have pushed, after a grace window; at once when every live island has
  pushed; or `round_timeout_s` after its first push with whatever arrived.
- Late push: a push whose base version is older than the open round's (its round
  committed without it) is *accepted into the open round* with its staleness
  recorded in the tape, up to `max_staleness`; older ones are rejected and the
  island carries the work into its next push. Nothing is mixed silently.
- Duplicate push: a repeated (learner, generation, seq) is answered "duplicate"
  and counted in the tape, never merged twice.
- Zero loss tokens: a round whose pushes all carry 0 loss tokens merges them with
  uniform weights (see `syncer.merge.MergeAccumulator`).
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from syncer import state
from syncer.merge import MergeAccumulator, NesterovOuter
from syncer.tape import Tape
from yeto import codec, frozen
from yeto.interop.adapters import run_adapter_tensors
from yeto.io import finite_or_none
from yeto.layout import Layout, LayoutMismatch, TensorSpec, fingerprint
from yeto.proto import yeto_pb2 as pb

log = logging.getLogger("syncer")

LEARNER_ID = re.compile(r"^[A-Za-z0-9_.@:-]{1,128}$")
LIVE = ("waiting", "training")


class Reject(Exception):
    """A call that must be refused; `code` maps to a gRPC status."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code  # invalid | precondition | not_found | unauthenticated


@dataclass
class Config:
    """The run's settings; the defaults are `python -m syncer`'s (its flags take them
    from here)."""

    quorum: int = 1
    rounds: int = 0
    outer_lr: float = 1.0       # plain averaging: the evidence in BENCHMARKS.md
    outer_momentum: float = 0.0
    merge: str = "mean"
    grace_ms: int = 500
    round_timeout_s: float = 600.0
    max_staleness: int = 1
    clip_factor: float = 0.0
    downlink: str = "f32"
    fragments: int = 1
    state_dir: Path | None = None
    resume: bool = False


@dataclass
class Member:
    """One island as the syncer's ledger sees it (one row per learner id)."""

    learner_id: str
    generation: int
    backend: str
    last_contact: float
    state: str = "waiting"  # waiting | training | finished | gone
    pushes: int = 0
    loss_tokens: int = 0
    last_seq: int = -1


@dataclass(frozen=True)
class Broadcast:
    version: int
    fragment: int
    payload: np.ndarray  # uint8 view of the f32 weights every island holds (this fragment)
    encoding: str
    final: bool
    delta: bytes | None = None  # compressed (new − previous) for islands at base_version
    base_version: int = 0


@dataclass
class OpenRound:
    fragment: int
    acc: MergeAccumulator
    responders: list = field(default_factory=list)
    learners: set = field(default_factory=set)
    first_push_at: float | None = None
    quorum_at: float | None = None
    bytes_in: int = 0
    duplicates: int = 0


class Run:
    def __init__(self, config: Config):
        self.cfg = config
        self.run_id = uuid.uuid4().hex[:12]
        self.cond = threading.Condition()
        self.outer = NesterovOuter(config.outer_lr, config.outer_momentum)
        self.tape = Tape(config.state_dir / "tape.jsonl" if config.state_dir else None)
        self.layout: Layout | None = None
        self.weights_file = "weights.safetensors"
        self.export_files: dict[str, str] = {}
        self.theta: np.ndarray | None = None
        self.momentum: np.ndarray | None = None
        # the weights every island holds: Θ itself with an f32 downlink; with q4, the
        # sum of the q4 updates sent so far (islands add the same bytes, so they hold
        # these exact bits; the gap to Θ rides along in the next update)
        self.island_theta: np.ndarray | None = None
        self.version = 0
        self.started = False
        self.finished = False
        self.islands: dict[str, Member] = {}  # the ledger, by learner id
        # random high bits: a restarted syncer never reuses a generation an island
        # remembers from before the restart
        self.next_generation = (secrets.randbits(31) << 32) + 1
        # one open round and one newest broadcast per fragment; fragment f's round
        # merges only f's slice of the flat vector (Streaming DiLoCo)
        self.open: dict[int, OpenRound] = {}
        self.broadcasts: dict[int, Broadcast] = {}
        self.commits: dict[int, list[int]] = {}  # versions at which each fragment committed
        self.bytes_in = self.bytes_out = self.rejected = 0
        self.last_commit_at: float | None = None
        self.final_delivered: set[str] = set()
        if config.state_dir is not None:
            self._restore_or_refuse(config.state_dir, config.resume)
        elif config.resume:
            raise state.StateError("--resume needs --state-dir (where the state was saved)")

    # ---- join -------------------------------------------------------------
    def join(self, learner_id: str, specs: list[TensorSpec], fp: str, backend: str,
             weights_file: str, export_files: dict[str, str]) -> dict:
        layout = self._check_join(learner_id, specs, fp)
        with self.cond:
            if self.finished:
                raise Reject("precondition", "this run has finished; start a new syncer")
            self._adopt_or_check_layout(learner_id, layout, weights_file, export_files)
            member = self._enroll(learner_id, backend)
            log.info("%s joined (generation %d, %s): %d/%d islands", learner_id,
                     member.generation, backend, self._live_count(), self.cfg.quorum)
            self._maybe_start()
            return dict(run_id=self.run_id, generation=member.generation,
                        num_fragments=self.cfg.fragments, send_seed=self.theta is None,
                        quorum=self.cfg.quorum, joined=self._live_count(),
                        version=self.version, finished=self.finished,
                        last_seq=member.last_seq)

    def _check_join(self, learner_id: str, specs: list[TensorSpec], fp: str) -> Layout:
        if not LEARNER_ID.match(learner_id or ""):
            raise Reject("invalid", f"learner id {learner_id!r} must be 1-128 characters of "
                         "letters, digits and _.@:- (example: --learner-id island-0)")
        try:
            layout = Layout(specs, self.cfg.fragments)
        except (LayoutMismatch, ValueError) as e:
            raise Reject("invalid", f"bad layout from {learner_id}: {e}") from None
        if fingerprint(specs) != fp:
            raise Reject("invalid", f"layout fingerprint from {learner_id} does not match its "
                         "tensor list (corrupted join message?)")
        return layout

    def _adopt_or_check_layout(self, learner_id: str, layout: Layout, weights_file: str,
                               export_files: dict[str, str]) -> None:
        """The first island's layout (and output files) become the run's; every later
        one must match it."""
        if self.layout is None:
            self.layout = layout
            self.weights_file = weights_file or self.weights_file
            self.export_files = dict(export_files)
            return
        try:
            self.layout.check_same(layout)
        except LayoutMismatch as e:
            raise Reject("precondition", f"{learner_id} cannot join: {e}. Every island "
                         "must train the same model with the same --lora-r/--lora-targets/"
                         "--tuning; check with scripts/check_name_parity.py") from None

    def _enroll(self, learner_id: str, backend: str) -> Member:
        """A new ledger row with a fresh generation; a rejoin keeps its counts, so
        seqs are never counted twice."""
        gen = self.next_generation
        self.next_generation += 1
        member = Member(learner_id, gen, backend or "?", time.monotonic(),
                        state="training" if self.started else "waiting")
        old = self.islands.get(learner_id)
        if old is not None:
            member.pushes, member.loss_tokens = old.pushes, old.loss_tokens
            member.last_seq = old.last_seq
        self.islands[learner_id] = member
        return member

    def _live(self) -> list[Member]:
        return [m for m in self.islands.values() if m.state in LIVE]

    def _live_count(self) -> int:
        return len(self._live())

    def _maybe_start(self) -> None:
        if self.started or self.theta is None or self._live_count() < self.cfg.quorum:
            return
        self.started = True
        for member in self._live():
            member.state = "training"
        for f in range(self.cfg.fragments):
            self.open[f] = OpenRound(f, self._accumulator(f))
            self.commits.setdefault(f, [self.version])
            self._publish(f, final=False)
        log.info("quorum of %d reached: round %d starts from version %d", self.cfg.quorum,
                 self.version + 1, self.version)

    def check_island(self, learner_id: str, generation: int) -> Member:
        """The caller's ledger row (call under `cond`); refuses unknown or stale callers."""
        member = self.islands.get(learner_id)
        if member is None:
            raise Reject("not_found", f"{learner_id!r} has not joined this run (join first)")
        if member.generation != generation:
            raise Reject("precondition", f"{learner_id}: connection generation {generation} is "
                         f"stale (current {member.generation}); the island must rejoin")
        member.last_contact = time.monotonic()
        return member

    def heartbeat(self, learner_id: str, generation: int) -> dict:
        """The caller's view of the run: version, the open round (0 if none), finished."""
        with self.cond:
            self.check_island(learner_id, generation)
            return dict(version=self.version, round=self.open_round(), finished=self.finished)

    def open_round(self) -> int:
        """The round a push joins now: 0 before round 1 starts and after the run ends."""
        return self.version + 1 if self.started and not self.finished else 0

    # ---- push -------------------------------------------------------------
    def check_push_header(self, h) -> int:
        """Validate a push header before any payload is read; returns the payload size."""
        with self.cond:
            self.check_island(h.learner_id, h.generation)
            if self.layout is None:
                raise Reject("precondition", "no layout yet")
            if h.encoding not in codec.ENCODINGS:
                raise Reject("invalid", f"unknown encoding {h.encoding!r}; "
                             f"use one of {', '.join(codec.ENCODINGS)}")
            numel = self._expected_numel(h)
            if h.numel != numel:
                raise Reject("invalid", f"push has {h.numel} elements, fragment {h.fragment} "
                             f"has {numel}")
            want = codec.encoded_size(h.encoding, h.numel)
            if h.payload_bytes != want:
                raise Reject("invalid", f"{h.encoding} payload for {h.numel} elements must be "
                             f"{want} bytes, header says {h.payload_bytes}")
            if h.kind == pb.SEED:
                if h.encoding != "f32":
                    raise Reject("invalid", "the seed must be sent in f32")
            else:
                self._check_round_open(h)
            # a repeated seq passes here: push() answers it "duplicate" and merges nothing
            return want

    def _expected_numel(self, h) -> int:
        if h.kind == pb.SEED:
            return self.layout.numel
        if h.fragment >= self.cfg.fragments:
            raise Reject("invalid", f"fragment {h.fragment} does not exist (the run has "
                         f"{self.cfg.fragments})")
        return self.layout.fragments[h.fragment].numel

    def _check_round_open(self, h) -> None:
        if self.finished:
            raise Reject("precondition", "the run has finished")
        if not self.started:
            raise Reject("precondition", "round 1 has not started (waiting for quorum)")
        if h.base_version > self.version:
            raise Reject("invalid", f"base version {h.base_version} is newer than the "
                         f"syncer's {self.version}")

    def push(self, h, payload: bytearray) -> dict:
        """Seed Θ, or add a pseudo-gradient to the open round of its fragment."""
        with self.cond:
            member = self.check_island(h.learner_id, h.generation)
            self.bytes_in += len(payload)
            if h.kind == pb.SEED:
                return self._seed(member, payload)
            if self.finished:
                raise Reject("precondition", "the run has finished")
            if h.round != h.base_version + 1:
                raise Reject("invalid", f"push for round {h.round} against base version "
                             f"{h.base_version}: a push joins round base_version + 1")
            rnd = self.open[h.fragment]
            if h.seq <= member.last_seq:
                return self._duplicate(rnd, h)
            staleness = self._staleness(h)
            try:
                weight = rnd.acc.add(payload, h.encoding, h.loss_tokens)
            except codec.CodecError as e:
                raise Reject("invalid", f"push from {h.learner_id} rejected: {e}") from None
            now = time.monotonic()
            self._record_push(member, rnd, h, len(payload), weight, staleness, now)
            self._maybe_commit(now)
            return dict(accepted=True, status="accepted", round=self.version + 1,
                        staleness=staleness)

    def _duplicate(self, rnd: OpenRound, h) -> dict:
        rnd.duplicates += 1
        self._reject_note(h.learner_id, "duplicate", f"seq {h.seq} already received")
        return dict(accepted=False, status="duplicate", round=self.version + 1, staleness=0)

    def _staleness(self, h) -> int:
        """Commits of this fragment the island had not seen when it pushed (the late-push
        rule: accepted up to `max_staleness`)."""
        staleness = sum(v > h.base_version for v in self.commits[h.fragment])
        if staleness > self.cfg.max_staleness:
            raise Reject("precondition", f"push from {h.learner_id} is {staleness} versions "
                         f"stale (max {self.cfg.max_staleness}); apply the newest broadcast "
                         "and push again")
        return staleness

    def _record_push(self, member: Member, rnd: OpenRound, h, nbytes: int, weight: float,
                     staleness: int, now: float) -> None:
        member.last_seq = h.seq
        member.pushes += 1
        if h.fragment == 0:  # each fragment's push carries the same steps: count once
            member.loss_tokens += h.loss_tokens
        rnd.bytes_in += nbytes
        rnd.learners.add(h.learner_id)
        rnd.responders.append(dict(
            learner=h.learner_id, tokens=int(h.loss_tokens), steps=int(h.steps),
            weight=weight, staleness=staleness, encoding=h.encoding, seq=int(h.seq),
            train_loss=finite_or_none(h.train_loss), eval_loss=finite_or_none(h.eval_loss)))
        if rnd.first_push_at is None:
            rnd.first_push_at = now
        if rnd.quorum_at is None and len(rnd.learners) >= self.cfg.quorum:
            rnd.quorum_at = now

    def _seed(self, member: Member, payload) -> dict:
        if self.theta is not None:
            return dict(accepted=False, status="duplicate", round=0, staleness=0)
        try:
            theta = codec.decode(payload, "f32", self.layout.numel)
        except codec.CodecError as e:
            raise Reject("invalid", f"seed from {member.learner_id} rejected: {e}") from None
        self.theta = theta
        self.momentum = np.zeros_like(theta)
        log.info("Θ seeded by %s (%d parameters)", member.learner_id, theta.size)
        self._maybe_start()
        return dict(accepted=True, status="accepted", round=0, staleness=0)

    def state_digest(self) -> str:
        """SHA-256 over everything a rejected message must leave untouched."""
        with self.cond:
            h = hashlib.sha256(f"{self.version}|{self.started}|{self.finished}".encode())
            for a in (self.theta, self.momentum):
                h.update(b"-" if a is None else a.tobytes())
            for f, rnd in sorted(self.open.items()):
                h.update(b"-" if rnd.acc.sum is None else rnd.acc.sum.tobytes())
                h.update(repr((f, len(rnd.responders), rnd.acc.total_weight,
                               rnd.acc.count)).encode())
            for m in sorted(self.islands.values(), key=lambda m: m.learner_id):
                h.update(repr((m.learner_id, m.generation, m.pushes, m.loss_tokens,
                               m.last_seq)).encode())
            return h.hexdigest()

    def note_rejected(self, call: str, learner: str, reject: Reject) -> None:
        """Every refused call is counted and written to the tape."""
        with self.cond:
            self._reject_note(learner, f"{call}:{reject.code}", str(reject))

    def _reject_note(self, learner: str, kind: str, detail: str) -> None:
        self.rejected += 1
        self.tape.write(dict(event="rejected", learner=learner, kind=kind, detail=detail,
                             round=self.version + 1, time=time.time()))

    # ---- commit -----------------------------------------------------------
    def tick(self) -> None:
        """Called periodically: commits rounds whose grace or timeout has passed."""
        with self.cond:
            if self.started and not self.finished:
                self._maybe_commit(time.monotonic())

    def _maybe_commit(self, now: float) -> None:
        for rnd in list(self.open.values()):
            if rnd.responders and not self.finished:
                reason = self._commit_reason(rnd, now)
                if reason:
                    self._commit(rnd, reason, now)

    def _commit_reason(self, rnd: OpenRound, now: float) -> str | None:
        live = {m.learner_id for m in self._live()}
        if live and live <= rnd.learners:
            return "all"  # nobody else is expected: no reason to wait for grace
        if rnd.quorum_at is not None and now >= rnd.quorum_at + self.cfg.grace_ms / 1000:
            return "quorum"
        if now >= rnd.first_push_at + self.cfg.round_timeout_s:
            return "timeout"
        if not live:
            return "finish"
        return None

    def _commit(self, rnd: OpenRound, reason: str, now: float) -> None:
        """Merge, step, save, tape, publish: in that order, so a crash never loses a
        version anyone has seen."""
        t0 = time.perf_counter()
        f = rnd.fragment
        lo, hi = self._span(f)
        g = rnd.acc.result()
        if rnd.acc.uniform_fallback:
            log.warning("round %d: every push carried 0 loss tokens; merged with uniform "
                        "weights", self.version + 1)
        self.outer.step(self.theta[lo:hi], self.momentum[lo:hi], g)
        self.version += 1
        self.commits[f].append(self.version)
        merge_s = time.perf_counter() - t0
        done = bool(self.cfg.rounds and self.version >= self.cfg.rounds)
        self.open[f] = OpenRound(f, self._accumulator(f, reuse=g))
        self.last_commit_at = now
        broadcast = self._next_broadcast(f, final=done)
        self._save()  # before anyone sees the new version: a crash never loses it
        self._tape_merge(rnd, reason, now, merge_s, broadcast)
        self.broadcasts[f] = broadcast
        self.cond.notify_all()
        log.info("round %d (fragment %d) committed (%s): %d pushes from %s", self.version, f,
                 reason, len(rnd.responders), ",".join(sorted(rnd.learners)))
        if done:
            self._final_broadcasts()
            self._finish_run()

    def _tape_merge(self, rnd: OpenRound, reason: str, now: float, merge_s: float,
                    broadcast: Broadcast) -> None:
        for r in rnd.responders:  # the weights the merge really used (uniform fallback)
            r["weight"] = rnd.acc.merged_weight(r["weight"])
        total_w = sum(r["weight"] for r in rnd.responders) or 1.0
        for r in rnd.responders:
            r["share"] = r["weight"] / total_w
        subscribers = self._live_count()
        self.tape.write(dict(
            event="merge", round=self.version, fragment=rnd.fragment, version=self.version,
            reason=reason, responders=rnd.responders, quorum=self.cfg.quorum,
            islands_live=subscribers, bytes_in=rnd.bytes_in,
            bytes_out=len(broadcast.delta or broadcast.payload) * subscribers,
            duplicates=rnd.duplicates, merge_seconds=merge_s, clip_scales=rnd.acc.clip_scales,
            round_seconds=now - rnd.first_push_at, outer_lr=self.outer.lr,
            outer_momentum=self.outer.momentum, merge_rule=self.cfg.merge,
            uniform_fallback=rnd.acc.uniform_fallback, time=time.time()))

    def _span(self, f: int) -> tuple[int, int]:
        frag = self.layout.fragments[f]
        return frag.start, frag.stop

    def _fragment_version(self, f: int) -> int:
        return self.commits[f][-1] if self.commits.get(f) else self.version

    def _accumulator(self, f: int, reuse: np.ndarray | None = None) -> MergeAccumulator:
        acc = MergeAccumulator(self.layout.fragments[f].numel, self.cfg.merge,
                               self.cfg.clip_factor)
        if reuse is not None:  # the last round's scratch: no new fragment-sized allocation
            reuse.fill(0.0)
            acc.sum = reuse
        return acc

    # ---- broadcast --------------------------------------------------------
    def _publish(self, f: int, final: bool) -> None:
        self.broadcasts[f] = self._next_broadcast(f, final)
        self.cond.notify_all()

    def _next_broadcast(self, f: int, final: bool) -> Broadcast:
        """Fragment f of Θ for the islands (updates `island_theta`); the caller publishes
        it. The final weights always go out exact, in f32."""
        lo, hi = self._span(f)
        prev = self.broadcasts.get(f)
        if self.island_theta is None:
            self.island_theta = self.theta.copy()
        delta = None
        if final or self.cfg.downlink == "f32" or prev is None:
            new = self.theta[lo:hi].copy()
        else:
            delta = codec.encode(self.theta[lo:hi] - self.island_theta[lo:hi],
                                 self.cfg.downlink)
            new = self.island_theta[lo:hi].copy()
            codec.decode_add(delta, self.cfg.downlink, new.size, new, 1.0)
        self.island_theta[lo:hi] = new  # `new` is what goes out: later rounds never touch it
        return Broadcast(self._fragment_version(f), f, new.view(np.uint8), "f32", final, delta,
                         prev.version if prev else 0)

    def _final_broadcasts(self) -> None:
        for f in range(self.cfg.fragments):
            self._publish(f, final=True)

    # ---- finish -----------------------------------------------------------
    def finish_island(self, learner_id: str, generation: int) -> bool:
        with self.cond:
            member = self.check_island(learner_id, generation)
            member.state = "finished"
            log.info("%s finished training", learner_id)
            self._maybe_finish_run()
            return self.finished

    def island_gone(self, learner_id: str, generation: int) -> None:
        with self.cond:
            member = self.islands.get(learner_id)
            if member and member.generation == generation and member.state in LIVE:
                member.state = "gone"
                log.warning("%s disconnected", learner_id)
                self._maybe_finish_run()

    def _maybe_finish_run(self) -> None:
        if self.finished or not self.started or self._live():
            return
        if not any(m.state == "finished" for m in self.islands.values()):
            return  # everyone vanished: keep Θ and wait for islands to come back
        for rnd in list(self.open.values()):
            if rnd.responders and not self.finished:
                self._commit(rnd, "finish", time.monotonic())
        if not self.finished:
            self._final_broadcasts()
            self._finish_run()

    def _finish_run(self) -> None:
        self.finished = True
        self.cond.notify_all()
        if self.cfg.state_dir is not None:
            self._write_final()
        log.info("run finished at version %d", self.version)

    def _write_final(self) -> None:
        """`state-dir/final/`: the final weights in the islands' file name, with frozen
        LoRA A rebuilt (it never travelled), their export files and provenance.json."""
        tensors = run_adapter_tensors(self.layout.unflatten(self.theta), self.export_files)
        files = dict(self.export_files)
        files.pop(frozen.EXPORT_FILE, None)  # A is rebuilt above: the seed file stays out
        record = state.final_provenance(self.cfg, self._run_record())
        state.write_final(self.cfg.state_dir / state.FINAL_DIR, self.weights_file, tensors,
                          self.version, files, record)

    def _run_record(self) -> dict:
        """What the final weights are: for provenance.json."""
        return dict(run_id=self.run_id, version=self.version, weights_file=self.weights_file,
                    theta_sha256=state.digest(self.theta), fingerprint=self.layout.fingerprint,
                    parameters=int(self.layout.numel), islands=self._ledger())

    def mark_final_delivered(self, learner_id: str) -> None:
        with self.cond:
            self.final_delivered.add(learner_id)

    def final_done(self) -> bool:
        """Every island that is still around has received the final weights."""
        with self.cond:
            waiting = {m.learner_id for m in self.islands.values() if m.state != "gone"}
            return waiting <= self.final_delivered

    # ---- state on disk ----------------------------------------------------
    def _flags(self) -> dict:
        return {k: getattr(self.cfg, k) for k in state.MATH_FLAGS}

    def _ledger(self) -> dict:
        return {m.learner_id: dict(backend=m.backend, pushes=m.pushes,
                                   loss_tokens=m.loss_tokens, last_seq=m.last_seq)
                for m in self.islands.values()}

    def _save(self) -> None:
        if self.cfg.state_dir is None:
            return
        state.save(self.cfg.state_dir, self.theta, self.momentum, self.island_theta, dict(
            run_id=self.run_id, version=self.version, round=self.version,
            fragment_versions=[self._fragment_version(f) for f in range(self.cfg.fragments)],
            fingerprint=self.layout.fingerprint,
            layout=[[s.name, list(s.shape), s.dtype] for s in self.layout.specs],
            flags=self._flags(), weights_file=self.weights_file, export_files=self.export_files,
            bytes_in=self.bytes_in, bytes_out=self.bytes_out, islands=self._ledger()))

    def _restore_or_refuse(self, state_dir: Path, resume: bool) -> None:
        if (state_dir / state.STATE_FILE).exists() and not resume:
            raise state.StateError(
                f"{state_dir} already holds a run's state; continue it with --resume, or "
                "choose a new --state-dir (it is never overwritten silently)")
        if resume:
            self._restore(state_dir)

    def _restore(self, state_dir: Path) -> None:
        theta, momentum, island_theta, meta = state.load(state_dir)
        state.check_flags(meta, self._flags())
        specs = [TensorSpec(n, tuple(shape), dt) for n, shape, dt in meta["layout"]]
        self.layout = Layout(specs, self.cfg.fragments)
        if self.layout.fingerprint != meta["fingerprint"] or self.layout.numel != theta.size:
            raise state.StateError(f"{state_dir}: layout and weights disagree (corrupt state)")
        self.run_id, self.version = meta["run_id"], meta["version"]
        self.theta, self.momentum = theta.copy(), momentum.copy()
        self.island_theta = None if island_theta is None else island_theta.copy()
        self.commits = {f: [v] for f, v in enumerate(meta["fragment_versions"])}
        self.weights_file, self.export_files = meta["weights_file"], meta["export_files"]
        self.bytes_in, self.bytes_out = meta["bytes_in"], meta["bytes_out"]
        for lid, row in meta["islands"].items():
            self.islands[lid] = Member(lid, 0, row["backend"], time.monotonic(), state="gone",
                                       pushes=row["pushes"], loss_tokens=row["loss_tokens"],
                                       last_seq=row["last_seq"])
        log.info("resumed run %s at version %d (%d islands in the ledger)", self.run_id,
                 self.version, len(self.islands))

    # ---- status -----------------------------------------------------------
    def status(self) -> dict:
        with self.cond:
            now = time.monotonic()
            return dict(
                run_id=self.run_id, round=self.version + 1,
                version=self.version, quorum=self.cfg.quorum, finished=self.finished,
                bytes_in=self.bytes_in, bytes_out=self.bytes_out,
                last_merge_s=now - self.last_commit_at if self.last_commit_at else -1.0,
                islands=[dict(learner_id=m.learner_id, state=m.state, generation=m.generation,
                              last_contact_s=now - m.last_contact, pushes=m.pushes,
                              loss_tokens=m.loss_tokens, backend=m.backend)
                         for m in self.islands.values()])
