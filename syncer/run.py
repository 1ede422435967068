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

import collections
import hashlib
import logging
import re
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from syncer import state
from syncer.bounds import SEED_MAX_ABS, BoundError, Bounds, NormHistory
from syncer.grace import AutoGrace
from syncer.merge import MergeAccumulator, NesterovOuter, NonFinite
from syncer.tape import Tape
from yeto import codec, frozen
from yeto.codec import chunked
from yeto.interop.adapters import run_adapter_tensors
from yeto.io import finite_or_none
from yeto.layout import Layout, LayoutMismatch, TensorSpec, fingerprint
from yeto.proto import yeto_pb2 as pb

log = logging.getLogger("syncer")

LEARNER_ID = re.compile(r"^[A-Za-z0-9_.@:-]{1,128}$")
LIVE = ("waiting", "training")


def _f32_owned(payload, numel: int, max_abs: float) -> np.ndarray:
    """An f32 payload within `max_abs` as a writable float32 array: the received
    buffer itself when the caller hands over a uint8 array it owns, else a copy."""
    codec.validate(payload, "f32", numel, max_abs)
    if isinstance(payload, np.ndarray) and payload.dtype == np.uint8 and \
            payload.flags.writeable and payload.flags.c_contiguous:
        return payload.view(np.float32)
    return codec.decode(payload, "f32", numel)


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
    # auto: syncer.grace, grace_ms until measured (BENCHMARKS.md, mixed-speed fleet:
    # level with the best fixed grace in loss, more goodput than 500 ms); fixed: grace_ms
    grace: str = "auto"
    round_timeout_s: float = 600.0
    max_staleness: int = 1
    clip_factor: float = 0.0
    downlink: str = "f32"
    fragments: int = 1
    state_dir: Path | None = None
    resume: bool = False
    expect_islands: tuple[str, ...] = ()  # reserved slots, listed as "reserved" until joined
    bounds: Bounds = field(default_factory=Bounds)  # what one island can do (syncer.bounds)
    # a commit whose state cannot be saved is retried this long; then the syncer stops
    save_timeout_s: float = 120.0

    def check(self) -> None:
        """Refuse settings that would make the outer step non-finite or meaningless."""
        if not (np.isfinite(self.outer_lr) and self.outer_lr > 0):
            raise ValueError(f"--outer-lr must be a positive number, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")
        self.bounds.check()


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
    tokens_per_step: int = 0  # declared at its first join (0: none; the run's cap binds)


class Source:
    """The f32 bytes a broadcast streams to islands that need the whole fragment: a
    view of the live weights (Θ, or the islands' weights under a compressed
    downlink), not a copy. Before a commit changes those weights it calls `detach`:
    the part that streams still in progress have not sent yet is copied, so they
    finish with the version they started (nothing is copied when none is in
    progress, the usual case); a source with no reader is retired. A chunk built for
    one reader is kept for the others until they have all passed it (at most
    `SHARED` chunks): islands streaming in step share one copy per chunk."""

    SHARED = 2  # chunks kept for readers behind (each net.CHUNK_BYTES at most)

    def __init__(self, array: np.ndarray):
        self._array: np.ndarray | None = array.view(np.uint8).reshape(-1)
        self.size = self._array.size
        self._offset = 0              # byte of the whole payload at self._array[0]
        self._live = True
        self._readers: dict[int, int] = {}  # reader -> the next byte it reads
        self._next = 0
        self._built: collections.OrderedDict[tuple, bytes] = collections.OrderedDict()
        self._lock = threading.Lock()

    def open(self) -> int:
        with self._lock:
            if self._array is None:
                raise RuntimeError("broadcast source retired before it was read")
            self._next += 1
            self._readers[self._next] = 0
            return self._next

    def read(self, reader: int, lo: int, hi: int, prefix: bytes = b"") -> bytes:
        """`prefix` + bytes [lo, hi) of the payload as one bytes object: built anew, or
        the one just built for another reader (islands streaming in step share it)."""
        with self._lock:
            self._readers[reader] = hi
            key = (lo, hi, prefix)
            data = self._built.get(key)
            if data is None:
                a = self._array[lo - self._offset:hi - self._offset]
                data = self._built[key] = b"".join((prefix, memoryview(a)))
            self._forget_passed()
            while len(self._built) > self.SHARED:
                self._built.popitem(last=False)
            return data

    def close(self, reader: int) -> None:
        with self._lock:
            self._readers.pop(reader, None)
            self._forget_passed()

    def _forget_passed(self) -> None:
        """Drop the built chunks every open reader has passed (all, with no reader)."""
        slowest = min(self._readers.values(), default=None)
        for key in [k for k in self._built if slowest is None or k[1] <= slowest]:
            del self._built[key]

    def detach(self) -> int:
        """Stop viewing the live weights; returns the bytes copied for readers."""
        with self._lock:
            if not self._live:
                return 0
            self._live = False
            if not self._readers:
                self._array = None
                return 0
            lo = min(self._readers.values())
            self._array = self._array[lo - self._offset:].copy()
            self._offset = lo
            return self._array.size


@dataclass(frozen=True)
class Broadcast:
    version: int
    fragment: int
    source: Source  # the f32 weights every island holds (this fragment)
    encoding: str
    final: bool
    delta: np.ndarray | None = None  # compressed (new − previous) for islands at base_version
    base_version: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes one island is sent: the update when there is one, else the weights."""
        return self.delta.size if self.delta is not None else self.source.size


@dataclass
class PendingCommit:
    """A round merged into Θ in memory whose state is not on disk yet: what publishing
    it needs once the save succeeds."""

    rnd: OpenRound
    reason: str
    now: float
    merge_s: float
    g: np.ndarray  # the round's sum buffer, scratch for the next round
    done: bool
    broadcast: Broadcast
    first_try: float
    next_try: float = 0.0
    tries: int = 0


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
    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic):
        config.check()
        self.cfg = config
        self.clock = clock  # seconds for grace windows and timeouts (yeto.sim: simulated)
        self.on_publish: Callable[[int, int], None] = lambda fragment, version: None
        self.run_id = uuid.uuid4().hex[:12]
        self.cond = threading.Condition()
        self.outer = NesterovOuter(config.outer_lr, config.outer_momentum)
        self.tape = Tape(config.state_dir / "tape.jsonl" if config.state_dir else None)
        self.pace = AutoGrace(config.grace_ms / 1000)
        self.layout: Layout | None = None
        self.weights_file = "weights.safetensors"
        self.export_files: dict[str, str] = {}
        self.theta: np.ndarray | None = None
        self._momentum: np.ndarray | None = None  # allocated only with momentum > 0
        # the weights every island holds under a compressed downlink: the sum of the
        # updates sent so far (islands add the same bytes, so they hold these exact
        # bits; the gap to Θ rides along in the next update). None with f32: Θ itself
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
        self.norms: dict[int, NormHistory] = {}  # accepted push norms per fragment
        self.pending: PendingCommit | None = None  # a commit whose state is not on disk yet
        self.problem = ""  # what keeps the run from committing, for status ("" if nothing)
        self.fatal: str | None = None  # why the run cannot go on: the syncer exits non-zero
        self.closing = False  # the syncer is stopping: nothing finishes the run now
        if config.state_dir is not None:
            self._restore_or_refuse(config.state_dir, config.resume)
        elif config.resume:
            raise state.StateError("--resume needs --state-dir (where the state was saved)")

    # ---- join -------------------------------------------------------------
    def join(self, learner_id: str, specs: list[TensorSpec], fp: str, backend: str,
             weights_file: str, export_files: dict[str, str], observer: bool = False,
             tokens_per_step: int = 0) -> dict:
        """An island joins; an `observer` (a rollout node) receives every Θ but never
        pushes, never seeds and never counts toward the quorum. `tokens_per_step`: the
        most loss tokens one of its steps holds (bounds its pushes' claims)."""
        layout = self._check_join(learner_id, specs, fp)
        with self.cond:
            if self.finished:
                raise Reject("precondition", "this run has finished; start a new syncer")
            self._adopt_or_check_layout(learner_id, layout, weights_file, export_files,
                                        observer)
            declared = self._declared_tokens(learner_id, tokens_per_step)
            member = self._enroll(learner_id, backend, observer)
            member.tokens_per_step = declared
            log.info("%s joined (generation %d, %s%s): %d/%d islands", learner_id,
                     member.generation, backend, ", observer" if observer else "",
                     self._live_count(), self.cfg.quorum)
            if observer:
                self.tape.write(dict(event="observer", learner=learner_id, backend=backend,
                                     version=self.version, time=time.time()))
            self._maybe_start()
            return dict(run_id=self.run_id, generation=member.generation,
                        num_fragments=self.cfg.fragments,
                        send_seed=self.theta is None and not observer,
                        quorum=self.cfg.quorum, joined=self._live_count(),
                        version=self.version, finished=self.finished,
                        last_seq=member.last_seq, downlink=self.cfg.downlink)

    def _check_join(self, learner_id: str, specs: list[TensorSpec], fp: str) -> Layout:
        if not LEARNER_ID.match(learner_id or ""):
            raise Reject("invalid", f"learner id {learner_id!r} must be 1-128 characters of "
                         "letters, digits and _.@:- (example: --learner-id island-0)")
        try:
            self.cfg.bounds.layout(specs)
            layout = Layout(specs, self.cfg.fragments)
        except (LayoutMismatch, ValueError) as e:
            raise Reject("invalid", f"bad layout from {learner_id}: {e}") from None
        if fingerprint(specs) != fp:
            raise Reject("invalid", f"layout fingerprint from {learner_id} does not match its "
                         "tensor list (corrupted join message?)")
        return layout

    def _adopt_or_check_layout(self, learner_id: str, layout: Layout, weights_file: str,
                               export_files: dict[str, str], observer: bool = False) -> None:
        """The first island's layout (and output files) become the run's; every later
        one must match it. An observer's layout is checked (or adopted) too, but the
        output files come from the first island."""
        if not observer and (self.layout is None or not self.export_files):
            self.weights_file = weights_file or self.weights_file
            self.export_files = dict(export_files)
        if self.layout is None:
            self.layout = layout
            return
        try:
            self.layout.check_same(layout)
        except LayoutMismatch as e:
            raise Reject("precondition", f"{learner_id} cannot join: {e}. Every island "
                         "must train the same model with the same --lora-r/--lora-targets/"
                         "--tuning; check with scripts/check_name_parity.py") from None

    def _declared_tokens(self, learner_id: str, tokens_per_step: int) -> int:
        """The tokens per step an island may claim: its first declaration, kept for the
        run (a rejoin may not raise it)."""
        try:
            declared = self.cfg.bounds.declaration(tokens_per_step)
        except BoundError as e:
            raise Reject("invalid", f"{learner_id} {e}") from None
        old = self.islands.get(learner_id)
        if old is None or not old.tokens_per_step:
            return declared
        if declared > old.tokens_per_step:
            raise Reject("precondition", f"{learner_id} declared {old.tokens_per_step} "
                         f"tokens per step when it first joined and now {declared}:"
                         " an island cannot raise its declaration mid-run (keep its batch "
                         "size and sequence length, or join under a new --learner-id)")
        return old.tokens_per_step

    def _enroll(self, learner_id: str, backend: str, observer: bool = False) -> Member:
        """A new ledger row with a fresh generation; a rejoin keeps its counts, so
        seqs are never counted twice. Observers are in state "observer" (never live)."""
        gen = self.next_generation
        self.next_generation += 1
        state = "observer" if observer else "training" if self.started else "waiting"
        member = Member(learner_id, gen, backend or "?", self.clock(), state=state)
        old = self.islands.get(learner_id)
        if old is not None:
            member.pushes, member.loss_tokens = old.pushes, old.loss_tokens
            member.last_seq = old.last_seq
            if old.state in (*LIVE, "observer"):
                log.warning("%s joined again: generation %d replaces %d, whose calls are "
                            "refused from now on", learner_id, gen, old.generation)
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
        member.last_contact = self.clock()
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
            member = self.check_island(h.learner_id, h.generation)
            if member.state == "observer":
                raise Reject("precondition", f"{h.learner_id} joined as an observer: "
                             "observers receive Θ and never push")
            self._check_saved()
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
                try:
                    self.cfg.bounds.claims(h.loss_tokens, h.steps, member.tokens_per_step)
                except BoundError as e:
                    raise Reject("invalid", f"{h.learner_id}: {e}") from None
            # a repeated seq passes here: push() answers it "duplicate" and merges nothing
            return want

    def max_abs(self, h) -> float:
        """The value bound of a push's elements (syncer.bounds): the seed's or a delta's."""
        return SEED_MAX_ABS if h.kind == pb.SEED else self.cfg.bounds.max_delta

    def _check_saved(self) -> None:
        """Refuse pushes while a commit waits for its state to reach the disk."""
        if self.fatal:
            raise Reject("precondition", f"the syncer is stopping: {self.fatal}")
        if self.pending is not None:
            raise Reject("exhausted", f"the syncer is waiting to save round "
                         f"{self.version + 1}: {self.problem}; the island retries")

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
            self._check_saved()
            if h.round != h.base_version + 1:
                raise Reject("invalid", f"push for round {h.round} against base version "
                             f"{h.base_version}: a push joins round base_version + 1")
            rnd = self.open[h.fragment]
            if h.seq <= member.last_seq:
                return self._duplicate(rnd, h)
            staleness = self._staleness(h)
            norms = self.norms.setdefault(h.fragment, NormHistory())
            try:
                weight, norm, scale = rnd.acc.add(payload, h.encoding, h.loss_tokens,
                                                  norms.limit(self.cfg.bounds.norm_factor))
            except codec.CodecError as e:
                raise Reject("invalid", f"push from {h.learner_id} rejected: {e}") from None
            norms.observe(norm * scale)
            if scale < 1.0:
                log.warning("push from %s: norm %.4g over the bound, scaled by %.4g",
                            h.learner_id, norm, scale)
            now = self.clock()
            self._record_push(member, rnd, h, len(payload), weight, staleness, now)
            rnd.responders[-1].update(norm=norm, bound_scale=scale)
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
        self.pace.observe(h.learner_id, h.fragment, now, h.loss_tokens)
        if rnd.first_push_at is None:
            rnd.first_push_at = now
        if rnd.quorum_at is None and len(rnd.learners) >= self.cfg.quorum:
            rnd.quorum_at = now

    def _seed(self, member: Member, payload) -> dict:
        if self.theta is not None:
            return dict(accepted=False, status="duplicate", round=0, staleness=0)
        try:
            theta = _f32_owned(payload, self.layout.numel, SEED_MAX_ABS)
        except codec.CodecError as e:
            raise Reject("invalid", f"seed from {member.learner_id} rejected: {e}") from None
        self.theta = theta
        if self.outer.momentum != 0:
            self._momentum = np.zeros_like(theta)
        log.info("Θ seeded by %s (%d parameters)", member.learner_id, theta.size)
        self._maybe_start()
        return dict(accepted=True, status="accepted", round=0, staleness=0)

    @property
    def momentum(self) -> np.ndarray | None:
        """The outer momentum m (zeros, made on request, when momentum is 0: then the
        run keeps no m at all)."""
        if self._momentum is None and self.theta is not None:
            return np.zeros_like(self.theta)
        return self._momentum

    def state_digest(self) -> str:
        """SHA-256 over everything a rejected message must leave untouched."""
        with self.cond:
            h = hashlib.sha256(f"{self.version}|{self.started}|{self.finished}".encode())
            for a in (self.theta, self._momentum):
                h.update(b"-" if a is None else memoryview(a).cast("B"))
            for f, rnd in sorted(self.open.items()):
                summed = rnd.acc.summed()
                h.update(b"-" if summed is None else memoryview(summed).cast("B"))
                h.update(repr((f, len(rnd.responders), rnd.acc.total_weight,
                               rnd.acc.count)).encode())
            for m in sorted(self.islands.values(), key=lambda m: m.learner_id):
                h.update(repr((m.learner_id, m.generation, m.pushes, m.loss_tokens,
                               m.last_seq, m.tokens_per_step)).encode())
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
    def tick(self, now: float | None = None) -> None:
        """Called periodically: commits rounds whose grace or timeout has passed by
        `now` (default: the run's clock)."""
        with self.cond:
            now = self.clock() if now is None else now
            if self.pending is not None:
                self._retry_save(now)
            elif self.started and not self.finished:
                self._maybe_commit(now)

    def _maybe_commit(self, now: float) -> None:
        for rnd in list(self.open.values()):
            if rnd.responders and not self.finished and self.pending is None \
                    and not self.fatal:
                reason = self._commit_reason(rnd, now)
                if reason:
                    self._commit(rnd, reason, now)

    def next_deadline(self) -> float | None:
        """When the first open round commits by its grace window or its timeout if no
        push comes meanwhile (None: no round waits on time). `yeto.sim` jumps there."""
        with self.cond:
            if not self.started or self.finished:
                return None
            live = {m.learner_id for m in self._live()}
            return min((t for rnd in self.open.values() if rnd.responders
                        for t, _ in self._deadlines(rnd, live)), default=None)

    def _deadlines(self, rnd: OpenRound, live: set[str]) -> list[tuple[float, str]]:
        """When a round with pushes commits by time alone, and why: at its quorum plus
        the grace window, or `round_timeout_s` after its first push."""
        out = [(rnd.first_push_at + self.cfg.round_timeout_s, "timeout")]
        if rnd.quorum_at is not None:
            out.insert(0, (rnd.quorum_at + self._grace_s(rnd, live), "quorum"))
        return out

    def _commit_reason(self, rnd: OpenRound, now: float) -> str | None:
        live = {m.learner_id for m in self._live()}
        if live and live <= rnd.learners:
            return "all"  # nobody else is expected: no reason to wait for grace
        for due, reason in self._deadlines(rnd, live):
            if now >= due:
                return reason
        if not live:
            return "finish"
        return None

    def _grace_s(self, rnd: OpenRound, live: set[str]) -> float:
        if self.cfg.grace != "auto":
            return self.cfg.grace_ms / 1000
        return self.pace.wait_s(rnd.fragment, rnd.quorum_at, rnd.learners, live - rnd.learners)

    def _commit(self, rnd: OpenRound, reason: str, now: float) -> None:
        """Merge, step, save, tape, publish: in that order, so a crash never loses a
        version anyone has seen. The round is committed once its state is on disk;
        until then (a full or failing disk) nobody sees the new version, pushes wait,
        and the save is retried (`_retry_save`)."""
        t0 = time.perf_counter()
        f = rnd.fragment
        lo, hi = self._span(f)
        self._detach_broadcast(f)  # Θ changes below: streams of the old version keep it
        m = None if self._momentum is None else self._momentum[lo:hi]
        try:
            g = rnd.acc.step_outer(self.outer, self.theta[lo:hi], m)
        except NonFinite as e:
            self.fail(f"round {self.version + 1}: {e}; Θ in memory is not the last "
                       "committed one. Restart the syncer with --resume (the state on disk "
                       "is the last committed round)")
            return
        if rnd.acc.uniform_fallback:
            log.warning("round %d: every push carried 0 loss tokens; merged with uniform "
                        "weights", self.version + 1)
        version = self.version + 1
        done = bool(self.cfg.rounds and version >= self.cfg.rounds)
        self.pending = PendingCommit(rnd, reason, now, time.perf_counter() - t0, g, done,
                                     self._next_broadcast(f, final=done, version=version),
                                     first_try=now)
        self._retry_save(now)

    def _retry_save(self, now: float) -> None:
        """Save the pending commit's state; on success the version is committed and
        published, else the syncer says why, retries on the ticker, and stops after
        `save_timeout_s` (the disk then holds the last committed round)."""
        p = self.pending
        if now < p.next_try:
            return
        try:
            self._save(self.version + 1, p.rnd.fragment)
        except OSError as e:
            self._save_failed(p, e, now)
            return
        self.pending, self.problem = None, ""
        self._committed(p)
        self._maybe_finish_run()  # islands that finished while the save waited

    def _save_failed(self, p: PendingCommit, e: OSError, now: float) -> None:
        first = not self.problem
        self.problem = f"cannot save the state to {self.cfg.state_dir}: {e}"
        p.next_try = now + min(5.0, 0.5 * 2 ** p.tries)
        p.tries += 1
        if first:
            log.error("round %d is not committed: %s; retrying for %.0f s (pushes wait)",
                      self.version + 1, self.problem, self.cfg.save_timeout_s)
            self.tape.write(dict(event="save_failed", round=self.version + 1,
                                 detail=str(e), time=time.time()))
        if now - p.first_try >= self.cfg.save_timeout_s:
            self.fail(f"{self.problem} (for {self.cfg.save_timeout_s:.0f} s). The state on "
                       f"disk is round {self.version}'s: free space (or fix the disk) and "
                       "restart the syncer with --resume")

    def fail(self, why: str) -> None:
        """The run cannot go on: `python -m syncer` exits non-zero with `why`."""
        with self.cond:
            log.critical("%s", why)
            self.fatal = why
            self.cond.notify_all()

    def _committed(self, p: PendingCommit) -> None:
        """A commit whose state is on disk: version, next round, tape, broadcast."""
        rnd, f = p.rnd, p.rnd.fragment
        self.version += 1
        self.commits[f].append(self.version)
        self.open[f] = OpenRound(f, self._accumulator(f, reuse=p.g))
        self.last_commit_at = p.now
        self._tape_merge(rnd, p.reason, p.now, p.merge_s, p.broadcast)
        self._announce(p.broadcast)
        log.info("round %d (fragment %d) committed (%s): %d pushes from %s", self.version, f,
                 p.reason, len(rnd.responders), ",".join(sorted(rnd.learners)))
        if p.done:
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
            bytes_out=broadcast.nbytes * subscribers,
            duplicates=rnd.duplicates, merge_seconds=merge_s, clip_scales=rnd.acc.clip_scales,
            round_seconds=now - rnd.first_push_at, outer_lr=self.outer.lr,
            outer_momentum=self.outer.momentum, merge_rule=self.cfg.merge,
            uniform_fallback=rnd.acc.uniform_fallback, time=time.time(),
            observers=sorted(m.learner_id for m in self.islands.values()
                             if m.state == "observer")))

    def _span(self, f: int) -> tuple[int, int]:
        frag = self.layout.fragments[f]
        return frag.start, frag.stop

    def _fragment_version(self, f: int) -> int:
        return self.commits[f][-1] if self.commits.get(f) else self.version

    def _accumulator(self, f: int, reuse: np.ndarray | None = None) -> MergeAccumulator:
        acc = MergeAccumulator(self.layout.fragments[f].numel, self.cfg.merge,
                               self.cfg.clip_factor, self.cfg.bounds.max_delta)
        if reuse is not None:  # the last round's scratch
            acc.reuse(reuse)
        return acc

    # ---- broadcast --------------------------------------------------------
    def _publish(self, f: int, final: bool) -> None:
        self._announce(self._next_broadcast(f, final, self._fragment_version(f)))

    def _announce(self, broadcast: Broadcast) -> None:
        """Make `broadcast` its fragment's newest: the streams send it on, and
        `on_publish(fragment, version)` hears of it (`yeto.sim` holds its clock)."""
        self.broadcasts[broadcast.fragment] = broadcast
        self.cond.notify_all()
        self.on_publish(broadcast.fragment, broadcast.version)

    def _next_broadcast(self, f: int, final: bool, version: int) -> Broadcast:
        """Fragment f of Θ for the islands (updates `island_theta`); the caller publishes
        it. The final weights always go out exact, in f32. Nothing is copied: the
        broadcast streams from the live weights (see `Source`), and a compressed
        update is encoded chunk by chunk into the one buffer all islands are sent."""
        lo, hi = self._span(f)
        prev = self.broadcasts.get(f)
        self._detach_broadcast(f)
        delta = None
        if self.cfg.downlink == "f32":
            source = self.theta[lo:hi]
        else:
            if self.island_theta is None:
                self.island_theta = self.theta.copy()
            source = self.island_theta[lo:hi]
            if final or prev is None:
                source[...] = self.theta[lo:hi]
            else:
                delta = chunked.encode_diff(self.theta[lo:hi], source, self.cfg.downlink)
        return Broadcast(version, f, Source(source), "f32", final, delta,
                         prev.version if prev else 0)

    def _detach_broadcast(self, f: int) -> None:
        """Before the weights of fragment f change: its broadcast stops viewing them."""
        prev = self.broadcasts.get(f)
        if prev is not None:
            copied = prev.source.detach()
            if copied:
                log.info("fragment %d: %d bytes of version %d kept for streams in progress",
                         f, copied, prev.version)

    def _final_broadcasts(self) -> None:
        for f in range(self.cfg.fragments):
            self._publish(f, final=True)

    # ---- finish -----------------------------------------------------------
    def finish_island(self, learner_id: str, generation: int) -> bool:
        with self.cond:
            member = self.check_island(learner_id, generation)
            if member.state == "observer":
                return self.finished  # an observer has no training to finish
            member.state = "finished"
            log.info("%s finished training", learner_id)
            self._maybe_finish_run()
            return self.finished

    def island_gone(self, learner_id: str, generation: int) -> None:
        with self.cond:
            member = self.islands.get(learner_id)
            if member and member.generation == generation and \
                    (member.state in LIVE or member.state == "observer"):
                member.state = "gone"
                log.warning("%s disconnected", learner_id)
                self._maybe_finish_run()

    def close(self) -> None:
        """The syncer is stopping (a signal): islands that drop off now are leaving a
        server that goes away, not finishing the run."""
        with self.cond:
            self.closing = True

    def _maybe_finish_run(self) -> None:
        if self.finished or not self.started or self._live() or self.closing:
            return
        if not any(m.state == "finished" for m in self.islands.values()):
            return  # everyone vanished: keep Θ and wait for islands to come back
        for rnd in list(self.open.values()):
            if rnd.responders and not self.finished and self.pending is None:
                self._commit(rnd, "finish", self.clock())
        if not self.finished and self.pending is None and not self.fatal:
            self._final_broadcasts()
            self._finish_run()

    def _finish_run(self) -> None:
        self.finished = True
        self.cond.notify_all()
        if self.cfg.state_dir is not None:
            try:
                self._write_final()
            except OSError as e:
                self.fail(f"cannot write the final weights to {self.cfg.state_dir}: {e}. "
                           f"The state holds them (version {self.version}): free space and "
                           "restart the syncer with --resume")
                return
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
                                   loss_tokens=m.loss_tokens, last_seq=m.last_seq,
                                   tokens_per_step=m.tokens_per_step)
                for m in self.islands.values()}

    def _save(self, version: int, fragment: int) -> None:
        """The state as of `version`, committed by `fragment`'s round (raises OSError)."""
        if self.cfg.state_dir is None:
            return
        versions = [version if f == fragment else self._fragment_version(f)
                    for f in range(self.cfg.fragments)]
        state.save(self.cfg.state_dir, self.theta, self._momentum, self.island_theta, dict(
            run_id=self.run_id, version=version, round=version, fragment_versions=versions,
            norm_history={str(f): h.values() for f, h in self.norms.items()},
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
        self.theta, self._momentum = theta, momentum if self.outer.momentum != 0 else None
        if self._momentum is None and self.outer.momentum != 0:
            self._momentum = np.zeros_like(theta)
        self.island_theta = island_theta if self.cfg.downlink != "f32" else None
        self.commits = {f: [v] for f, v in enumerate(meta["fragment_versions"])}
        self.weights_file, self.export_files = meta["weights_file"], meta["export_files"]
        self.bytes_in, self.bytes_out = meta["bytes_in"], meta["bytes_out"]
        for f, norms in meta.get("norm_history", {}).items():
            self.norms[int(f)] = NormHistory(norms)
        for lid, row in meta["islands"].items():
            self.islands[lid] = Member(lid, 0, row["backend"], self.clock(), state="gone",
                                       pushes=row["pushes"], loss_tokens=row["loss_tokens"],
                                       last_seq=row["last_seq"],
                                       tokens_per_step=row.get("tokens_per_step", 0))
        log.info("resumed run %s at version %d (%d islands in the ledger)", self.run_id,
                 self.version, len(self.islands))
        self.tape.write(dict(event="resumed", version=self.version, time=time.time()))

    # ---- status -----------------------------------------------------------
    def status(self) -> dict:
        with self.cond:
            now = self.clock()
            return dict(
                run_id=self.run_id, round=self.version + 1, problem=self.fatal or self.problem,
                version=self.version, quorum=self.cfg.quorum, finished=self.finished,
                bytes_in=self.bytes_in, bytes_out=self.bytes_out,
                last_merge_s=now - self.last_commit_at if self.last_commit_at else -1.0,
                islands=[dict(learner_id=m.learner_id, state=m.state, generation=m.generation,
                              last_contact_s=now - m.last_contact, pushes=m.pushes,
                              loss_tokens=m.loss_tokens, backend=m.backend)
                         for m in self.islands.values()] + self._reserved())

    def _reserved(self) -> list[dict]:
        """Expected islands (`--expect-islands`) that have not joined yet."""
        return [dict(learner_id=i, state="reserved", generation=0, last_contact_s=-1.0,
                     pushes=0, loss_tokens=0, backend="?")
                for i in self.cfg.expect_islands if i not in self.islands]
