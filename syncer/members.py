"""Membership: the ledger of islands (one row per learner id), their connection
generations, and who is live.

A join gets a fresh generation; a rejoin of the same id keeps its counts (so seqs
are never counted twice) and makes the earlier connection stale. Observers (rollout
nodes) are in the ledger too, in state "observer": never live, never in the quorum.
Callers hold the run's lock (`syncer.run.Run.cond`).
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from syncer.bounds import BoundError, Bounds
from syncer.config import Config
from syncer.errors import Reject
from syncer.strategy import REGIMES
from yeto.layout import Layout, LayoutMismatch, TensorSpec, fingerprint

log = logging.getLogger("syncer")

LEARNER_ID = re.compile(r"[A-Za-z0-9_.@:-]{1,128}")  # whole (fullmatch): no newline after it
BACKEND = re.compile(r"[A-Za-z0-9_.-]{0,32}")  # informational, shown in logs and status
LIVE = ("waiting", "training")


@dataclass
class Member:
    """One island as the syncer's ledger sees it (one row per learner id)."""

    learner_id: str
    generation: int
    backend: str
    last_contact: float
    state: str = "waiting"  # waiting | training | finished | gone | observer
    pushes: int = 0
    loss_tokens: int = 0
    last_seq: int = -1
    tokens_per_step: int = 0  # declared at its first join (0: none; the run's cap binds)
    sync_every: int = 0       # steps between its pushes, declared at its first join (0: none)
    # per fragment, the run's version when its last push there was accepted (or it joined)
    pushed_at: dict[int, int] = field(default_factory=dict)
    joined_at: int = 0
    fingerprint: str = ""     # the layout it joined with (an observer's is checked later)
    init_sha256: bytes = b""  # the digest of its initial weights it declared (b"": none)
    # the run's clock when this syncer first enrolled it (or restored it from the state),
    # and per fragment when its last push there was accepted: the wall time it trained
    enrolled_clock: float = 0.0
    accepted_clock: dict[int, float] = field(default_factory=dict)

    def missed(self, fragment: int, commits: list[int]) -> int:
        """Commits of `fragment` (the versions in `commits`) since its last accepted push
        there: rounds whose steps it may be carrying."""
        since = self.pushed_at.get(fragment, self.joined_at)
        return sum(v > since for v in commits)

    def trained_for(self, fragment: int, now: float) -> float:
        """Seconds of the run's clock since its last accepted push to `fragment` (or since
        this syncer enrolled it): the wall time its next push there can have trained."""
        return max(0.0, now - self.accepted_clock.get(fragment, self.enrolled_clock))

    def accepted(self, fragment: int, version: int, seq: int, loss_tokens: int,
                 now: float) -> None:
        """Its push `seq` to `fragment` was summed into the round open on `version`, at
        `now` (the run's clock)."""
        self.pushed_at[fragment], self.accepted_clock[fragment] = version, now
        self.last_seq, self.pushes = seq, self.pushes + 1
        if fragment == 0:  # each fragment's push carries the same steps: count once
            self.loss_tokens += loss_tokens


def _kept(learner_id: str, what: str, first: int, now: int, keep: str) -> int:
    """A declaration as the run keeps it: the first one (0: none yet), which a rejoin may
    lower but not raise."""
    if not first:
        return now
    if now > first:
        raise Reject("precondition", f"{learner_id} declared {first} {what} when it first "
                     f"joined and now {now}: an island cannot raise its "
                     f"declaration mid-run (keep {keep}, or join under a new --learner-id)")
    return first


def check_learner_id(learner_id: str) -> None:
    if not LEARNER_ID.fullmatch(learner_id or ""):
        raise Reject("invalid", f"learner id {learner_id!r} must be 1-128 characters of "
                     "letters, digits and _.@:- (example: --learner-id island-0)")


class Members:
    def __init__(self, bounds: Bounds, clock: Callable[[], float]):
        self.bounds, self.clock = bounds, clock
        self.rows: dict[str, Member] = {}
        # random high bits: a restarted syncer never reuses a generation an island
        # remembers from before the restart
        self.next_generation = (secrets.randbits(31) << 32) + 1

    def enroll(self, learner_id: str, backend: str, state: str, tokens_per_step: int,
               sync_every: int = 0, version: int = 0, fingerprint: str = "",
               init_sha256: bytes = b"") -> Member:
        """A new row with a fresh generation for `learner_id` (checks its declarations of
        tokens per step and steps between pushes first: a rejoin may raise neither).
        `version`: the run's, now."""
        try:
            self.bounds.declaration(tokens_per_step)
        except BoundError as e:
            raise Reject("invalid", f"{learner_id} {e}") from None
        old = self.rows.get(learner_id)
        declared = (_kept(learner_id, "tokens per step", old.tokens_per_step if old else 0,
                          tokens_per_step, "its batch size and sequence length"),
                    _kept(learner_id, "steps between pushes", old.sync_every if old else 0,
                          sync_every, "its --sync-every"))
        gen = self.next_generation
        self.next_generation += 1
        now = self.clock()
        member = Member(learner_id, gen, backend or "?", now, state=state,
                        tokens_per_step=declared[0], sync_every=declared[1],
                        joined_at=version, fingerprint=fingerprint, init_sha256=init_sha256,
                        enrolled_clock=now)
        if old is not None:
            member.pushes, member.loss_tokens = old.pushes, old.loss_tokens
            member.last_seq, member.pushed_at = old.last_seq, old.pushed_at
            member.joined_at, member.enrolled_clock = old.joined_at, old.enrolled_clock
            member.accepted_clock = old.accepted_clock
            if old.state in (*LIVE, "observer"):
                log.warning("%s joined again: generation %d replaces %d, whose calls are "
                            "refused from now on", learner_id, gen, old.generation)
        self.rows[learner_id] = member
        return member

    def evict_observers(self, fingerprint: str) -> list[str]:
        """Observers that joined before the run had a layout, with another one: their
        connection goes stale (their calls are refused; a rejoin meets the layout check)."""
        evicted = []
        for m in self.rows.values():
            if m.state == "observer" and m.fingerprint != fingerprint:
                m.generation, m.state = self.next_generation, "gone"
                self.next_generation += 1
                evicted.append(m.learner_id)
        return evicted

    def start_training(self) -> None:
        """Round 1 starts: every waiting island trains."""
        for member in self.live():
            member.state = "training"

    def finished(self, learner_id: str) -> None:
        self.rows[learner_id].state = "finished"

    def gone(self, learner_id: str, generation: int) -> bool:
        """`learner_id`'s connection `generation` dropped: whether that made it gone (a
        stale connection or an island already finished changes nothing)."""
        member = self.rows.get(learner_id)
        if member and member.generation == generation and \
                (member.state in LIVE or member.state == "observer"):
            member.state = "gone"
            return True
        return False

    def check(self, learner_id: str, generation: int) -> Member:
        """The caller's row; refuses unknown or stale callers (and notes the contact)."""
        member = self.rows.get(learner_id)
        if member is None:
            raise Reject("not_found", f"{learner_id!r} has not joined this run (join first)")
        if member.generation != generation:
            raise Reject("precondition", f"{learner_id}: connection generation {generation} is "
                         f"stale (current {member.generation}); the island must rejoin")
        member.last_contact = self.clock()
        return member

    def live(self) -> list[Member]:
        return [m for m in self.rows.values() if m.state in LIVE]

    def live_ids(self) -> set[str]:
        return {m.learner_id for m in self.live()}

    def initial_weights(self) -> list[tuple[str, bytes]]:
        """The live training islands in the order they first joined, each with the
        digest of its initial weights it declared (b"": none)."""
        return [(m.learner_id, m.init_sha256) for m in self.live()]

    def in_state(self, state: str) -> list[str]:
        return sorted(m.learner_id for m in self.rows.values() if m.state == state)

    # ---- the saved ledger and status ----------------------------------------------------
    def ledger(self) -> dict[str, Any]:
        """What the state file keeps of each island."""
        return {m.learner_id: dict(backend=m.backend, pushes=m.pushes,
                                   loss_tokens=m.loss_tokens, last_seq=m.last_seq,
                                   tokens_per_step=m.tokens_per_step,
                                   sync_every=m.sync_every)
                for m in self.rows.values()}

    def restore(self, ledger: dict[str, Any]) -> None:
        """Rows from a saved ledger, every island "gone" until it rejoins."""
        for lid, row in ledger.items():
            self.rows[lid] = Member(lid, 0, row["backend"], self.clock(), state="gone",
                                    enrolled_clock=self.clock(),
                                    pushes=row["pushes"], loss_tokens=row["loss_tokens"],
                                    last_seq=row["last_seq"],
                                    tokens_per_step=row.get("tokens_per_step", 0),
                                    sync_every=row.get("sync_every", 0))

    def status(self, expected: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        """A row per island, then the expected ones (`--expect-islands`) not yet joined,
        as "reserved"."""
        now = self.clock()
        rows = [dict(learner_id=m.learner_id, state=m.state, generation=m.generation,
                     last_contact_s=now - m.last_contact, pushes=m.pushes,
                     loss_tokens=m.loss_tokens, backend=m.backend)
                for m in self.rows.values()]
        return rows + [dict(learner_id=i, state="reserved", generation=0, last_contact_s=-1.0,
                            pushes=0, loss_tokens=0, backend="?")
                       for i in expected if i not in self.rows]

    def digest_parts(self) -> list[tuple[object, ...]]:
        return [(m.learner_id, m.generation, m.pushes, m.loss_tokens, m.last_seq,
                 m.tokens_per_step, m.sync_every, sorted(m.pushed_at.items()))
                for m in sorted(self.rows.values(), key=lambda m: m.learner_id)]


def checked_regime(learner_id: str, regime: str) -> str:
    """What a joining island says it trains ("sft" when it says nothing), or a refusal."""
    regime = regime or "sft"
    if regime not in REGIMES:
        raise Reject("invalid", f"{learner_id}: unknown regime {regime[:32]!r}; use one of "
                                f"{', '.join(REGIMES)}")
    return regime


def checked_layout(cfg: Config, learner_id: str, specs: list[TensorSpec], fp: str,
                   backend: str = "") -> Layout:
    """The layout a joining island declares, checked: its id and backend name (shown in
    logs, the tape and `yeto status`: no control characters), the bounds (sane shapes,
    size), and the fingerprint it sent."""
    check_learner_id(learner_id)
    if not BACKEND.fullmatch(backend or ""):
        raise Reject("invalid", f"{learner_id}: backend {backend[:40]!r} must be at most 32 "
                                "letters, digits and _.- (torch, mlx, numpy)")
    try:
        cfg.bounds.layout(specs)
        layout = Layout(specs, cfg.fragments)
    except (LayoutMismatch, ValueError) as e:
        raise Reject("invalid", f"bad layout from {learner_id}: {e}") from None
    if fingerprint(specs) != fp:
        raise Reject("invalid", f"layout fingerprint from {learner_id} does not match its "
                     "tensor list (corrupted join message?)")
    return layout
