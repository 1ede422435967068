"""Round pacing: the open round of each fragment, and when it commits.

Round r is open on base version r-1. It commits when K = quorum distinct islands
have pushed, after a grace window (`--grace auto`: `syncer.grace`; fixed: --grace-ms);
at once when every live island has pushed; or `round_timeout_s` after its first
push with whatever arrived.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from syncer.grace import AutoGrace
from syncer.merge import MergeAccumulator


@dataclass
class OpenRound:
    fragment: int
    acc: MergeAccumulator
    responders: list[dict[str, Any]] = field(default_factory=list)  # the tape's, per push
    learners: set[str] = field(default_factory=set)
    first_push_at: float | None = None
    quorum_at: float | None = None
    bytes_in: int = 0
    duplicates: int = 0

    @property
    def started_at(self) -> float:
        """When its first push joined it (a round commits only with pushes)."""
        if self.first_push_at is None:
            raise RuntimeError(f"the round of fragment {self.fragment} has no push yet")
        return self.first_push_at

    def joined(self, learner_id: str, now: float, quorum: int) -> None:
        """A push from `learner_id` joined the round at `now`."""
        self.learners.add(learner_id)
        if self.first_push_at is None:
            self.first_push_at = now
        if self.quorum_at is None and len(self.learners) >= quorum:
            self.quorum_at = now


class Pacing:
    def __init__(self, quorum: int, grace: str, grace_ms: int, round_timeout_s: float):
        self.quorum, self.grace, self.grace_ms = quorum, grace, grace_ms
        self.round_timeout_s = round_timeout_s
        self.pace = AutoGrace(grace_ms / 1000)

    def pushed(self, rnd: OpenRound, learner_id: str, loss_tokens: int, now: float) -> None:
        """A push joined `rnd` at `now`."""
        rnd.joined(learner_id, now, self.quorum)
        self.pace.observe(learner_id, rnd.fragment, now, loss_tokens)

    def reason(self, rnd: OpenRound, live: set[str], now: float) -> str | None:
        """Why `rnd` commits at `now` (None: it waits on)."""
        if live and live <= rnd.learners:
            return "all"  # nobody else is expected: no reason to wait for grace
        for due, reason in self.deadlines(rnd, live):
            if now >= due:
                return reason
        if not live:
            return "finish"
        return None

    def deadlines(self, rnd: OpenRound, live: set[str]) -> list[tuple[float, str]]:
        """When a round with pushes commits by time alone, and why: at its quorum plus
        the grace window, or `round_timeout_s` after its first push."""
        if rnd.first_push_at is None:
            return []
        out = [(rnd.first_push_at + self.round_timeout_s, "timeout")]
        if rnd.quorum_at is not None:
            out.insert(0, (rnd.quorum_at + self._grace_s(rnd, rnd.quorum_at, live), "quorum"))
        return out

    def _grace_s(self, rnd: OpenRound, quorum_at: float, live: set[str]) -> float:
        if self.grace != "auto":
            return self.grace_ms / 1000
        return self.pace.wait_s(rnd.fragment, quorum_at, rnd.learners, live - rnd.learners)
