"""The open rounds: one per fragment, each with its running sum of pushes
(`syncer.merge.MergeAccumulator`), who pushed, and when it is due to commit
(`syncer.pacing`); the push norms the bound follows (`syncer.bounds.NormBounds`);
and the push that stages into a round's sum while it arrives (`syncer.staging`).

`Rounds` alone changes them. Callers hold the run's lock.

Late push: a push whose base version is older than the open round's (its round
committed without it) is accepted into the open round with its staleness recorded in
the tape, up to `max_staleness`; older ones are refused and the island carries the work
into its next push. A repeated (learner, generation, seq) is answered "duplicate" and
never merged twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from syncer import strategy
from syncer.bounds import Bounds, NormBounds
from syncer.errors import Reject
from syncer.members import Member
from syncer.merge import MergeAccumulator
from syncer.messages import PushHeader
from syncer.pacing import OpenRound, Pacing
from syncer.staging import Pushed, StagedSum
from yeto import codec
from yeto.codec import buffers
from yeto.io import finite_or_none

if TYPE_CHECKING:
    import hashlib

log = logging.getLogger("syncer")


class Rounds:
    """Each fragment's open round and what decides how a push is summed into it."""

    def __init__(self, rule: strategy.Mean, bounds: Bounds, clip_factor: float,
                 max_staleness: int, pacing: Pacing, clock: Callable[[], float]):
        self.rule, self.bounds, self.clip_factor = rule, bounds, clip_factor
        self.max_staleness = max_staleness
        self.pacing, self.clock = pacing, clock
        self.open: dict[int, OpenRound] = {}
        self.norms = NormBounds(bounds.norm_factor)

    # ---- opening --------------------------------------------------------------------
    def start(self, numels: dict[int, int], islands: int) -> None:
        """Round 1 of each fragment opens (fragment f: `numels[f]` values; a shard opens
        only its own)."""
        for f, numel in numels.items():
            self.open[f] = OpenRound(f, self._accumulator(numel, islands))

    def reopen(self, f: int, numel: int, islands: int, reuse: np.ndarray | None) -> None:
        """Fragment f's round committed: the next one opens (on the last one's sum
        buffer, `reuse`, as scratch)."""
        acc = self._accumulator(numel, islands)
        if reuse is not None:
            acc.reuse(reuse)
        self.open[f] = OpenRound(f, acc)

    def _accumulator(self, numel: int, islands: int) -> MergeAccumulator:
        acc = MergeAccumulator(numel, self.rule, self.clip_factor, self.bounds.max_delta,
                               self.bounds.share_cap, self.bounds.center_factor)
        acc.expect(islands)  # more may join, or push (`add`)
        return acc

    def expect(self, islands: int) -> None:
        """`islands` may push to every open round now (an island joined)."""
        for rnd in self.open.values():
            rnd.acc.expect(islands)

    def get(self, f: int) -> OpenRound:
        rnd = self.open.get(f)
        if rnd is None:
            raise Reject("precondition", f"fragment {f} has no open round")
        return rnd

    def keeps_pushes(self, fragment: int) -> bool:
        """Whether a push to `fragment` is kept as received until its round commits
        (clipping, or a round that may be share-capped) instead of summed as it comes.
        Read without the lock: a push that finds another round at its end is copied."""
        rnd = self.open.get(fragment)
        return rnd.acc.keeps_pushes if rnd else self.clip_factor > 0 or self.rule.keeps_pushes

    # ---- a push ---------------------------------------------------------------------
    def take(self, member: Member, h: PushHeader, payload: Pushed, owned: bool,
             commits: Iterable[int], live: set[str], version: int) -> int | None:
        """Take push `h` into its round: its staleness (`commits`: the versions of this
        fragment's commits), or None when it was received already (counted, never
        merged twice). A whole push takes the round's buffer from a push still staging
        into it (`take_turn`)."""
        self._take_turn(h, payload)
        if h.seq <= member.last_seq:
            self.get(h.fragment).duplicates += 1
            return None
        stale = sum(v > h.base_version for v in commits)
        if stale > self.max_staleness:
            raise Reject("precondition", f"push from {h.learner_id} is {stale} versions "
                         f"stale (max {self.max_staleness}); apply the newest broadcast "
                         "and push again")
        self._add(member, h, payload, stale, owned, live, version)
        return stale

    def _add(self, member: Member, h: PushHeader, payload: Pushed, staleness: int,
             owned: bool, live: set[str], version: int) -> None:
        """Sum push `h` into its round, within the norm bound (`syncer.bounds`). A round
        that keeps its pushes keeps a copy of one the run does not own (`owned`: False,
        a pooled buffer, received while another round was open). `live`: the live
        islands; `version`: the run's."""
        rnd = self.get(h.fragment)
        # the islands that may push to this round, this one included: a third makes the
        # share cap bind (its pushes from here on are kept until the commit)
        rnd.acc.expect(len(live | {r["learner"] for r in rnd.responders} | {h.learner_id}))
        staged = isinstance(payload, StagedSum) and not payload.demoted  # summed already
        if rnd.acc.keeps_pushes and not owned and not staged:
            payload = _copy(payload)
        try:
            added = rnd.acc.add(payload, h.encoding, h.loss_tokens,
                                self.norms.limit(h.fragment, h.learner_id), h.learner_id)
        except codec.CodecError as e:
            raise Reject("invalid", f"push from {h.learner_id} rejected: {e}") from None
        self.norms.observe(h.fragment, h.learner_id, added.norm)
        member.accepted(h.fragment, version, h.seq, h.loss_tokens, self.clock())
        if added.scale < 1.0:
            log.warning("push from %s: norm %.4g over the bound, scaled by %.4g",
                        h.learner_id, added.norm, added.scale)
        rnd.bytes_in += len(payload)
        rnd.responders.append(dict(
            learner=h.learner_id, tokens=int(h.loss_tokens), steps=int(h.steps),
            weight=added.weight, staleness=staleness, encoding=h.encoding, seq=int(h.seq),
            train_loss=finite_or_none(h.train_loss), eval_loss=finite_or_none(h.eval_loss),
            norm=added.norm, bound_scale=added.scale))
        self.pacing.pushed(rnd, h.learner_id, h.loss_tokens, self.clock())

    # ---- staging (`syncer.staging`) -------------------------------------------------
    def claim(self, h: PushHeader, keep: buffers.SpilledPayload | np.ndarray
              ) -> StagedSum | None:
        """A `StagedSum` for push `h` into its fragment's open round, its bytes kept in
        `keep` too, when it may stage there (see `syncer.staging`), else None (it
        arrives whole into `keep`)."""
        rnd = self.open.get(h.fragment)
        if h.seed or self.clip_factor > 0 or rnd is None:
            return None
        acc = rnd.acc
        weight = acc.weight_for(h.loss_tokens)
        if acc.keeps_pushes or acc.staging is not None or acc.count or not acc.fresh or \
                weight <= 0:
            return None
        staged = StagedSum(acc, h.encoding, h.numel, weight, keep)
        acc.stage(staged)
        return staged

    def make_way(self, h: PushHeader) -> None:
        """Push `h` starts beside others: the push staging into its fragment's open
        round goes on as a whole one, unless it is half in (then it most likely ends
        first)."""
        rnd = None if h.seed else self.open.get(h.fragment)
        stager = None if rnd is None else rnd.acc.staging
        if rnd is not None and stager is not None and 2 * stager.lo < stager.numel:
            rnd.acc.unstage(demote=True)

    @staticmethod
    def release(staged: StagedSum) -> None:
        """The staged push's stream is over: its round is free again."""
        if staged.acc.staging is staged:
            staged.acc.unstage()

    def _take_turn(self, h: PushHeader, payload: Pushed) -> None:
        """A push that is not the one staging into its fragment's open round takes that
        round's buffer as it is summed: the stager goes on as a whole push. Nobody
        waits for a push still arriving."""
        rnd = None if h.seed else self.open.get(h.fragment)
        if rnd is not None and rnd.acc.staging is not None and rnd.acc.staging is not payload:
            rnd.acc.unstage(demote=True)

    # ---- when rounds commit (`syncer.pacing`) ---------------------------------------
    def due(self, live: set[str], now: float) -> list[tuple[OpenRound, str]]:
        """The rounds with pushes that commit at `now`, and why."""
        out = []
        for rnd in list(self.open.values()):
            if rnd.responders:
                reason = self.pacing.reason(rnd, live, now)
                if reason:
                    out.append((rnd, reason))
        return out

    def with_pushes(self) -> list[OpenRound]:
        return [rnd for rnd in list(self.open.values()) if rnd.responders]

    def next_deadline(self, live: set[str]) -> float | None:
        """When the first round with pushes commits by time alone (None: none does)."""
        return min((t for rnd in self.open.values() if rnd.responders
                    for t, _ in self.pacing.deadlines(rnd, live)), default=None)

    # ---- norms and digest -----------------------------------------------------------
    def seed_norms(self, theta: np.ndarray, spans: list[tuple[int, int]]) -> None:
        """Each fragment's norm ceiling from Θ as seeded."""
        self.norms.seed(theta, spans)

    def restore_norms(self, saved: Any, theta: np.ndarray, spans: list[tuple[int, int]]) -> None:
        self.norms.restore(saved)
        if not self.norms.has_ceiling():  # a state saved before the bound had one
            self.norms.seed(theta, spans)

    def norm_record(self) -> dict[str, Any]:
        return self.norms.saved()

    def digest_into(self, h: hashlib._Hash) -> None:
        for f, rnd in sorted(self.open.items()):
            summed = rnd.acc.summed()
            h.update(b"-" if summed is None else summed.data.cast("B"))
            h.update(repr((f, len(rnd.responders), rnd.acc.total_weight,
                           rnd.acc.count)).encode())


def _copy(payload: Pushed) -> bytes | np.ndarray:
    """A push's bytes in memory of their own."""
    if isinstance(payload, StagedSum):  # demoted: a whole push in its keep buffer
        payload = payload.payload()
    if isinstance(payload, buffers.SpilledPayload):
        return payload.read(slice(0, len(payload)))
    return payload.copy() if isinstance(payload, np.ndarray) else bytes(payload)
