"""The outer loop's state machine: islands, Θ and momentum, the open round.

Transport-free: the gRPC service validates wire framing and calls in here; all
state changes happen under one lock, and every input is checked before it
touches state (a rejected call leaves the run exactly as it was).

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
"""

from __future__ import annotations

import logging
import math
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
from yeto.layout import Layout, LayoutMismatch, TensorSpec, fingerprint

log = logging.getLogger("syncer")

LEARNER_ID = re.compile(r"^[A-Za-z0-9_.@:-]{1,128}$")


class Reject(Exception):
    """A call that must be refused; `code` maps to a gRPC status."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code  # invalid | precondition | not_found | unauthenticated


@dataclass
class Config:
    quorum: int = 1
    rounds: int = 0
    outer_lr: float = 1.0       # plain averaging: the evidence in BENCHMARKS.md
    outer_momentum: float = 0.0
    merge: str = "mean"
    grace_ms: int = 0
    round_timeout_s: float = 600.0
    max_staleness: int = 1
    clip_factor: float = 0.0
    downlink: str = "f32"
    fragments: int = 1
    state_dir: Path | None = None
    resume: bool = False


@dataclass
class Island:
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
    delta: bytes | None = None  # q4(Θ − held) against base_version, for islands holding it
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
        tape_path = config.state_dir / "tape.jsonl" if config.state_dir else None
        self.tape = Tape(tape_path)
        self.layout: Layout | None = None
        self.weights_file = "weights.safetensors"
        self.export_files: dict[str, str] = {}
        self.theta: np.ndarray | None = None
        self.momentum: np.ndarray | None = None
        # the weights every island holds: Θ itself with an f32 downlink; with q4, the
        # sum of the q4 updates sent so far (islands add the same bytes, so they hold
        # these exact bits; the gap to Θ rides along in the next update)
        self.held: np.ndarray | None = None
        self.version = 0
        self.started = False
        self.finished = False
        self.islands: dict[str, Island] = {}
        # random high bits: a restarted syncer never reuses a generation an island
        # remembers from before the restart
        self.next_generation = (secrets.randbits(31) << 32) + 1
        # one open round and one newest broadcast per fragment; fragment f's round
        # merges only f's slice of the flat vector (Streaming DiLoCo)
        self.open: dict[int, OpenRound] = {}
        self.broadcasts: dict[int, Broadcast] = {}
        self.commits: dict[int, list[int]] = {}  # versions at which each fragment committed
        self.bytes_in = 0
        self.bytes_out = 0
        self.rejected = 0
        self.last_commit_at: float | None = None
        self.final_delivered: set[str] = set()
        if config.state_dir is not None:
            self._restore_or_refuse(config.state_dir, config.resume)
        elif config.resume:
            raise state.StateError("--resume needs --state-dir (where the state was saved)")

    # ---- state on disk ----------------------------------------------------
    def _flags(self) -> dict:
        return {k: getattr(self.cfg, k) for k in state.MATH_FLAGS}

    def _restore_or_refuse(self, state_dir: Path, resume: bool) -> None:
        exists = (state_dir / state.STATE_FILE).exists()
        if exists and not resume:
            raise state.StateError(
                f"{state_dir} already holds a run's state; continue it with --resume, or "
                "choose a new --state-dir (it is never overwritten silently)")
        if not resume:
            return
        theta, momentum, held, meta = state.load(state_dir)
        state.check_flags(meta, self._flags())
        specs = [TensorSpec(n, tuple(shape), dt) for n, shape, dt in meta["layout"]]
        self.layout = Layout(specs, self.cfg.fragments)
        if self.layout.fingerprint != meta["fingerprint"] or self.layout.numel != theta.size:
            raise state.StateError(f"{state_dir}: layout and weights disagree (corrupt state)")
        self.run_id, self.version = meta["run_id"], meta["version"]
        self.theta, self.momentum = theta.copy(), momentum.copy()
        self.held = held
        self.commits = {f: [v] for f, v in enumerate(meta["fragment_versions"])}
        self.weights_file, self.export_files = meta["weights_file"], meta["export_files"]
        self.bytes_in, self.bytes_out = meta["bytes_in"], meta["bytes_out"]
        for lid, led in meta["islands"].items():
            self.islands[lid] = Island(lid, 0, led["backend"], time.monotonic(), state="gone",
                                       pushes=led["pushes"], loss_tokens=led["loss_tokens"],
                                       last_seq=led["last_seq"])
        log.info("resumed run %s at version %d (%d islands in the ledger)", self.run_id,
                 self.version, len(self.islands))

    def _save(self) -> None:
        if self.cfg.state_dir is None:
            return
        state.save(self.cfg.state_dir, self.theta, self.momentum, self.held, dict(
            run_id=self.run_id, version=self.version, round=self.version,
            fragment_versions=[self._fragment_version(f) for f in range(self.cfg.fragments)],
            fingerprint=self.layout.fingerprint,
            layout=[[s.name, list(s.shape), s.dtype] for s in self.layout.specs],
            flags=self._flags(), weights_file=self.weights_file, export_files=self.export_files,
            bytes_in=self.bytes_in, bytes_out=self.bytes_out,
            islands={i.learner_id: dict(backend=i.backend, pushes=i.pushes,
                                        loss_tokens=i.loss_tokens, last_seq=i.last_seq)
                     for i in self.islands.values()}))

    # ---- join -------------------------------------------------------------
    def join(self, learner_id: str, specs: list[TensorSpec], fp: str, backend: str,
             weights_file: str, export_files: dict[str, str]) -> dict:
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
        with self.cond:
            if self.finished:
                raise Reject("precondition", "this run has finished; start a new syncer")
            if self.layout is None:
                self.layout = layout
                self.weights_file = weights_file or self.weights_file
                self.export_files = dict(export_files)
            else:
                try:
                    self.layout.check_same(layout)
                except LayoutMismatch as e:
                    raise Reject("precondition", f"{learner_id} cannot join: {e}. Every island "
                                 "must train the same model with the same --lora-r/"
                                 "--lora-targets/--tuning; check with "
                                 "scripts/check_name_parity.py") from None
            gen = self.next_generation
            self.next_generation += 1
            old = self.islands.get(learner_id)
            isl = Island(learner_id, gen, backend or "?", time.monotonic(),
                         state="training" if self.started else "waiting")
            if old is not None:  # a rejoin keeps the ledger: seqs are never counted twice
                isl.pushes, isl.loss_tokens = old.pushes, old.loss_tokens
                isl.last_seq = old.last_seq
            self.islands[learner_id] = isl
            log.info("%s joined (generation %d, %s): %d/%d islands", learner_id, gen, backend,
                     self._live_count(), self.cfg.quorum)
            self._maybe_start()
            return dict(run_id=self.run_id, generation=gen, num_fragments=self.cfg.fragments,
                        send_seed=self.theta is None, quorum=self.cfg.quorum,
                        joined=self._live_count(), version=self.version, finished=self.finished,
                        last_seq=isl.last_seq)

    def _live(self) -> list[Island]:
        return [i for i in self.islands.values() if i.state in ("waiting", "training")]

    def _live_count(self) -> int:
        return len(self._live())

    def _maybe_start(self) -> None:
        if self.started or self.theta is None or self._live_count() < self.cfg.quorum:
            return
        self.started = True
        for isl in self._live():
            isl.state = "training"
        for f in range(self.cfg.fragments):
            self.open[f] = OpenRound(f, self._accumulator(f))
            self.commits.setdefault(f, [self.version])
            self._publish(f, final=False)
        log.info("quorum of %d reached: round %d starts from version %d", self.cfg.quorum,
                 self.version + 1, self.version)

    # ---- push -------------------------------------------------------------
    def check_island(self, learner_id: str, generation: int) -> Island:
        isl = self.islands.get(learner_id)
        if isl is None:
            raise Reject("not_found", f"{learner_id!r} has not joined this run (join first)")
        if isl.generation != generation:
            raise Reject("precondition", f"{learner_id}: connection generation {generation} is "
                         f"stale (current {isl.generation}); the island must rejoin")
        isl.last_contact = time.monotonic()
        return isl

    def check_push_header(self, h) -> int:
        """Validate a push header before any payload is read; returns the payload size."""
        with self.cond:
            isl = self.check_island(h.learner_id, h.generation)
            if self.layout is None:
                raise Reject("precondition", "no layout yet")
            if h.encoding not in codec.ENCODINGS:
                raise Reject("invalid", f"unknown encoding {h.encoding!r}; "
                             f"use one of {', '.join(codec.ENCODINGS)}")
            numel = self.layout.numel
            if h.kind != 1:
                if h.fragment >= self.cfg.fragments:
                    raise Reject("invalid", f"fragment {h.fragment} does not exist (the run has "
                                 f"{self.cfg.fragments})")
                numel = self.layout.fragments[h.fragment].numel
            if h.numel != numel:
                raise Reject("invalid", f"push has {h.numel} elements, fragment {h.fragment} "
                             f"has {numel}")
            want = codec.encoded_size(h.encoding, h.numel)
            if h.payload_bytes != want:
                raise Reject("invalid", f"{h.encoding} payload for {h.numel} elements must be "
                             f"{want} bytes, header says {h.payload_bytes}")
            if h.kind == 1:  # SEED
                if h.encoding != "f32":
                    raise Reject("invalid", "the seed must be sent in f32")
            else:
                if self.finished:
                    raise Reject("precondition", "the run has finished")
                if not self.started:
                    raise Reject("precondition", "round 1 has not started (waiting for quorum)")
                if h.base_version > self.version:
                    raise Reject("invalid", f"base version {h.base_version} is newer than the "
                                 f"syncer's {self.version}")
                if h.seq <= isl.last_seq:
                    pass  # duplicate: answered in push(), never merged
            return want

    def push(self, h, payload: bytearray) -> dict:
        with self.cond:
            isl = self.check_island(h.learner_id, h.generation)
            self.bytes_in += len(payload)
            if h.kind == 1:
                return self._seed(isl, payload)
            if self.finished:
                raise Reject("precondition", "the run has finished")
            if h.round != h.base_version + 1:
                raise Reject("invalid", f"push for round {h.round} against base version "
                             f"{h.base_version}: a push joins round base_version + 1")
            rnd = self.open[h.fragment]
            if h.seq <= isl.last_seq:
                rnd.duplicates += 1
                self._reject_note(h.learner_id, "duplicate", f"seq {h.seq} already received")
                return dict(accepted=False, status="duplicate", round=self.version + 1,
                            staleness=0)
            # commits of this fragment the island had not seen when it pushed
            staleness = sum(v > h.base_version for v in self.commits[h.fragment])
            if staleness > self.cfg.max_staleness:
                raise Reject("precondition", f"push from {h.learner_id} is {staleness} versions "
                             f"stale (max {self.cfg.max_staleness}); apply the newest broadcast "
                             "and push again")
            try:
                weight = rnd.acc.add(payload, h.encoding, h.loss_tokens)
            except codec.CodecError as e:
                raise Reject("invalid", f"push from {h.learner_id} rejected: {e}") from None
            now = time.monotonic()
            isl.last_seq = h.seq
            isl.pushes += 1
            if h.fragment == 0:  # each fragment's push carries the same steps: count once
                isl.loss_tokens += h.loss_tokens
            rnd.bytes_in += len(payload)
            rnd.learners.add(h.learner_id)
            rnd.responders.append(dict(
                learner=h.learner_id, tokens=int(h.loss_tokens), steps=int(h.steps),
                weight=weight, staleness=staleness, encoding=h.encoding, seq=int(h.seq),
                train_loss=_finite_or_none(h.train_loss), eval_loss=_finite_or_none(h.eval_loss)))
            if rnd.first_push_at is None:
                rnd.first_push_at = now
            if rnd.quorum_at is None and len(rnd.learners) >= self.cfg.quorum:
                rnd.quorum_at = now
            self._maybe_commit(now)
            return dict(accepted=True, status="accepted", round=self.version + 1,
                        staleness=staleness)

    def _seed(self, isl: Island, payload) -> dict:
        if self.theta is not None:
            return dict(accepted=False, status="duplicate", round=0, staleness=0)
        try:
            theta = codec.decode(payload, "f32", self.layout.numel)
        except codec.CodecError as e:
            raise Reject("invalid", f"seed from {isl.learner_id} rejected: {e}") from None
        self.theta = theta
        self.momentum = np.zeros_like(theta)
        log.info("Θ seeded by %s (%d parameters)", isl.learner_id, theta.size)
        self._maybe_start()
        return dict(accepted=True, status="accepted", round=0, staleness=0)

    def state_digest(self) -> str:
        """SHA-256 over everything a rejected message must leave untouched."""
        import hashlib

        with self.cond:
            h = hashlib.sha256(f"{self.version}|{self.started}|{self.finished}".encode())
            for a in (self.theta, self.momentum):
                h.update(b"-" if a is None else a.tobytes())
            for f, rnd in sorted(self.open.items()):
                h.update(b"-" if rnd.acc.sum is None else rnd.acc.sum.tobytes())
                h.update(repr((f, len(rnd.responders), rnd.acc.total_weight)).encode())
            for i in sorted(self.islands.values(), key=lambda i: i.learner_id):
                h.update(repr((i.learner_id, i.generation, i.pushes, i.loss_tokens,
                               i.last_seq)).encode())
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
                self._maybe_commit_round(rnd, now)

    def _maybe_commit_round(self, rnd: OpenRound, now: float) -> None:
        live = {i.learner_id for i in self._live()}
        reason = None
        if live and live <= rnd.learners:
            reason = "all"  # nobody else is expected: no reason to wait for grace
        elif rnd.quorum_at is not None and now >= rnd.quorum_at + self.cfg.grace_ms / 1000:
            reason = "quorum"
        elif now >= rnd.first_push_at + self.cfg.round_timeout_s:
            reason = "timeout"
        elif not live:
            reason = "finish"
        if reason:
            self._commit(rnd, reason, now)

    def _commit(self, rnd: OpenRound, reason: str, now: float) -> None:
        t0 = time.perf_counter()
        f = rnd.fragment
        lo, hi = self._span(f)
        try:
            g = rnd.acc.result()
        except ValueError as e:  # all pushes had zero loss tokens: skip the step
            log.warning("round %d: %s; Θ unchanged", self.version + 1, e)
            g = None
        if g is not None:
            self.outer.step(self.theta[lo:hi], self.momentum[lo:hi], g)
        self.version += 1
        self.commits[f].append(self.version)
        merge_s = time.perf_counter() - t0
        total_w = sum(r["weight"] for r in rnd.responders) or 1.0
        for r in rnd.responders:
            r["share"] = r["weight"] / total_w
        done = self.cfg.rounds and self.version >= self.cfg.rounds
        self.open[f] = OpenRound(f, self._accumulator(f, reuse=g))
        self.last_commit_at = now
        broadcast = self._next_broadcast(f, final=bool(done))
        self._save()  # before anyone sees the new version: a crash never loses it
        subscribers = self._live_count()
        self.tape.write(dict(
            event="merge", round=self.version, fragment=f, version=self.version, reason=reason,
            responders=rnd.responders, quorum=self.cfg.quorum, islands_live=subscribers,
            bytes_in=rnd.bytes_in,
            bytes_out=len(broadcast.delta or broadcast.payload) * subscribers,
            duplicates=rnd.duplicates, merge_seconds=merge_s, clip_scales=rnd.acc.clipped,
            round_seconds=now - rnd.first_push_at, outer_lr=self.outer.lr,
            outer_momentum=self.outer.momentum, merge_rule=self.cfg.merge, time=time.time()))
        self.broadcasts[f] = broadcast
        self.cond.notify_all()
        log.info("round %d (fragment %d) committed (%s): %d pushes from %s", self.version, f,
                 reason, len(rnd.responders), ",".join(sorted(rnd.learners)))
        if done:
            self._final_broadcasts()
            self._finish_run()

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

    def _publish(self, f: int, final: bool) -> None:
        self.broadcasts[f] = self._next_broadcast(f, final)
        self.cond.notify_all()

    def _next_broadcast(self, f: int, final: bool) -> Broadcast:
        """Fragment f of Θ for the islands (updates `held`); published by the caller."""
        lo, hi = self._span(f)
        prev = self.broadcasts.get(f)
        if self.held is None:
            self.held = self.theta.copy()
        delta = None
        if final or self.cfg.downlink == "f32" or prev is None:
            new = self.theta[lo:hi].copy()  # the final weights always go out exact, in f32
        else:
            delta = codec.encode(self.theta[lo:hi] - self.held[lo:hi], self.cfg.downlink)
            new = self.held[lo:hi].copy()
            codec.decode_add(delta, self.cfg.downlink, new.size, new, 1.0)
        self.held[lo:hi] = new  # `new` is what goes out: later rounds never touch it
        return Broadcast(self._fragment_version(f), f, new.view(np.uint8), "f32", final, delta,
                         prev.version if prev else 0)

    def _final_broadcasts(self) -> None:
        for f in range(self.cfg.fragments):
            self._publish(f, final=True)

    # ---- finish -----------------------------------------------------------
    def finish_island(self, learner_id: str, generation: int) -> bool:
        with self.cond:
            isl = self.check_island(learner_id, generation)
            isl.state = "finished"
            log.info("%s finished training", learner_id)
            self._maybe_finish_run()
            return self.finished

    def island_gone(self, learner_id: str, generation: int) -> None:
        with self.cond:
            isl = self.islands.get(learner_id)
            if isl and isl.generation == generation and isl.state in ("waiting", "training"):
                isl.state = "gone"
                log.warning("%s disconnected", learner_id)
                self._maybe_finish_run()

    def _maybe_finish_run(self) -> None:
        if self.finished or not self.started or self._live():
            return
        if not any(i.state == "finished" for i in self.islands.values()):
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
        from safetensors.numpy import save_file

        out = self.cfg.state_dir / "final"
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: np.ascontiguousarray(v) for k, v in self.layout.unflatten(self.theta).items()}
        if frozen.EXPORT_FILE in self.export_files:  # frozen-A mode: A never travelled
            tensors.update(frozen.rebuild(self.export_files[frozen.EXPORT_FILE]))
        tmp = out / (self.weights_file + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt", "yeto_version": str(self.version)})
        tmp.replace(out / self.weights_file)
        for name, text in self.export_files.items():
            if "/" in name or name.startswith(".") or name == frozen.EXPORT_FILE:
                continue  # file names only: never a path from the wire
            (out / name).write_text(text)

    def mark_final_delivered(self, learner_id: str) -> None:
        with self.cond:
            self.final_delivered.add(learner_id)

    def final_done(self) -> bool:
        """Every island that is still around has received the final weights."""
        with self.cond:
            waiting = {i.learner_id for i in self.islands.values() if i.state != "gone"}
            return waiting <= self.final_delivered

    # ---- status -----------------------------------------------------------
    def status(self) -> dict:
        with self.cond:
            now = time.monotonic()
            return dict(
                run_id=self.run_id, round=self.version + 1,
                version=self.version, quorum=self.cfg.quorum, finished=self.finished,
                bytes_in=self.bytes_in, bytes_out=self.bytes_out,
                last_merge_s=now - self.last_commit_at if self.last_commit_at else -1.0,
                islands=[dict(learner_id=i.learner_id, state=i.state, generation=i.generation,
                              last_contact_s=now - i.last_contact, pushes=i.pushes,
                              loss_tokens=i.loss_tokens, backend=i.backend)
                         for i in self.islands.values()])


def _finite_or_none(x: float):
    return float(x) if math.isfinite(x) else None
