"""A push from its header to its round: what it must meet before any of it touches
a round (caller, layout, encoding, size, round, claims, the late-push rule), then
its sum into the round within the norm bound, or the seed.

Late push: a push whose base version is older than the open round's (its round
committed without it) is accepted into the open round with its staleness recorded
in the tape, up to `max_staleness`; older ones are refused and the island carries
the work into its next push. A repeated (learner, generation, seq) passes here and
is answered "duplicate" by the run, never merged twice.
"""

from __future__ import annotations

import logging

import numpy as np

from syncer import state, stepping
from syncer.bounds import SEED_MAX_ABS, BoundError
from syncer.errors import Reject
from syncer.members import Member
from syncer.messages import PushHeader
from syncer.pacing import OpenRound
from syncer.staging import StagedSum
from yeto import codec
from yeto.codec import buffers
from yeto.io import finite_or_none

log = logging.getLogger("syncer")


def check_header(run, member: Member, h: PushHeader) -> int:
    """Refuse a header the run cannot take now; returns the payload size."""
    if member.state == "observer":
        raise Reject("precondition", f"{h.learner_id} joined as an observer: "
                     "observers receive Θ and never push")
    check_saved(run)
    if run.layout is None:
        raise Reject("precondition", "no layout yet")
    if h.encoding not in codec.ENCODINGS:
        raise Reject("invalid", f"unknown encoding {h.encoding!r}; "
                     f"use one of {', '.join(codec.ENCODINGS)}")
    numel = _expected_numel(run, h)
    if h.numel != numel:
        raise Reject("invalid", f"push has {h.numel} elements, fragment {h.fragment} "
                     f"has {numel}")
    want = codec.encoded_size(h.encoding, h.numel)
    if h.payload_bytes != want:
        raise Reject("invalid", f"{h.encoding} payload for {h.numel} elements must be "
                     f"{want} bytes, header says {h.payload_bytes}")
    if h.seed:
        if h.encoding != "f32":
            raise Reject("invalid", "the seed must be sent in f32")
        return want
    _check_round_open(run, h)
    try:
        run.cfg.bounds.claims(h.loss_tokens, h.steps, member.tokens_per_step,
                              member.sync_every,
                              member.missed(h.fragment, run.commits.get(h.fragment, [])))
    except BoundError as e:
        raise Reject("invalid", f"{h.learner_id}: {e}") from None
    return want


def check_saved(run) -> None:
    """Refuse pushes while a commit waits for its state to reach the disk; wait (up to
    `syncer.stepping.WAIT_S`) while an outer step runs behind its broadcast."""
    if run.pending is not None and run.pending.stepping:
        run.cond.wait_for(lambda: run.pending is None or not run.pending.stepping
                          or run.fatal, timeout=stepping.WAIT_S)
    if run.fatal:
        raise Reject("precondition", f"the syncer is stopping: {run.fatal}")
    if run.pending is not None:
        why = "to finish the outer step of" if run.pending.stepping else "to save"
        problem = f": {run.problem}" if run.problem else ""
        raise Reject("exhausted", f"the syncer is waiting {why} round "
                     f"{run.version + 1}{problem}; the island retries")


def max_abs(run, h: PushHeader) -> float:
    """The value bound of a push's elements (syncer.bounds): the seed's or a delta's."""
    return SEED_MAX_ABS if h.seed else run.cfg.bounds.max_delta


def _expected_numel(run, h: PushHeader) -> int:
    if h.seed:
        return run.layout.numel
    if h.fragment >= run.cfg.fragments:
        raise Reject("invalid", f"fragment {h.fragment} does not exist (the run has "
                     f"{run.cfg.fragments})")
    return run.layout.fragments[h.fragment].numel


def _check_round_open(run, h: PushHeader) -> None:
    if run.finished:
        raise Reject("precondition", "the run has finished")
    if not run.started:
        raise Reject("precondition", "round 1 has not started (waiting for quorum)")
    if h.base_version > run.version:
        raise Reject("invalid", f"base version {h.base_version} is newer than the "
                     f"syncer's {run.version}")


def check_delta(run, h: PushHeader) -> None:
    """What a delta must meet once its payload is in, as the run stands then."""
    if run.finished:
        raise Reject("precondition", "the run has finished")
    check_saved(run)
    if h.round != h.base_version + 1:
        raise Reject("invalid", f"push for round {h.round} against base version "
                     f"{h.base_version}: a push joins round base_version + 1")


def staleness(run, h: PushHeader) -> int:
    """Commits of this fragment the island had not seen when it pushed (accepted up to
    `max_staleness`)."""
    stale = sum(v > h.base_version for v in run.commits[h.fragment])
    if stale > run.cfg.max_staleness:
        raise Reject("precondition", f"push from {h.learner_id} is {stale} versions "
                     f"stale (max {run.cfg.max_staleness}); apply the newest broadcast "
                     "and push again")
    return stale


def add_delta(run, member: Member, rnd: OpenRound, h: PushHeader, payload,
              staleness: int, owned: bool = True) -> None:
    """Sum a push into its round, within the norm bound (`syncer.bounds`). A round that
    keeps its pushes keeps a copy of one the run does not own (`owned`: False, a pooled
    buffer, received while another round was open)."""
    # the islands that may push to this round, this one included: a third makes the
    # share cap bind (its pushes from here on are kept until the commit)
    rnd.acc.expect(len(run.members.live_ids() | {r["learner"] for r in rnd.responders}
                       | {h.learner_id}))
    staged = isinstance(payload, StagedSum) and not payload.demoted  # summed already
    if rnd.acc.keeps_pushes and not owned and not staged:
        payload = _copy(payload)
    try:
        added = rnd.acc.add(payload, h.encoding, h.loss_tokens,
                            run.norms.limit(h.fragment, h.learner_id), h.learner_id)
    except codec.CodecError as e:
        raise Reject("invalid", f"push from {h.learner_id} rejected: {e}") from None
    run.norms.observe(h.fragment, h.learner_id, added.norm)
    member.pushed_at[h.fragment] = run.version
    if added.scale < 1.0:
        log.warning("push from %s: norm %.4g over the bound, scaled by %.4g",
                    h.learner_id, added.norm, added.scale)
    member.last_seq, member.pushes = h.seq, member.pushes + 1
    if h.fragment == 0:  # each fragment's push carries the same steps: count once
        member.loss_tokens += h.loss_tokens
    rnd.bytes_in += len(payload)
    rnd.responders.append(dict(
        learner=h.learner_id, tokens=int(h.loss_tokens), steps=int(h.steps),
        weight=added.weight, staleness=staleness, encoding=h.encoding, seq=int(h.seq),
        train_loss=finite_or_none(h.train_loss), eval_loss=finite_or_none(h.eval_loss),
        norm=added.norm, bound_scale=added.scale))
    run.pacing.pushed(rnd, h.learner_id, h.loss_tokens, run.clock())


def seed(run, member: Member, payload) -> dict:
    """Θ from the seeding island's initial weights (`Run.seeder`; a later seed is a
    duplicate, and any other island's is refused)."""
    if run.theta is not None:
        return dict(accepted=False, status="duplicate", round=0, staleness=0)
    if member.learner_id != run.seeder:
        raise Reject("precondition", f"{member.learner_id} was not asked for the seed: "
                     f"{run.seeder or 'the first island to join'} seeds Θ (the syncer's "
                     "--seed-from names it)")
    try:
        theta = _f32_owned(payload, run.layout.numel, SEED_MAX_ABS)
    except codec.CodecError as e:
        raise Reject("invalid", f"seed from {member.learner_id} rejected: {e}") from None
    run.theta = theta
    if run.outer.keeps_momentum:
        run.m = np.zeros_like(theta)
    run.norms.seed(theta, [run.span(f) for f in range(run.cfg.fragments)])
    log.info("Θ seeded by %s (%d parameters)", member.learner_id, theta.size)
    run.tape.event("seeded", learner=member.learner_id, theta_sha256=state.digest(theta))
    run.maybe_start()
    return dict(accepted=True, status="accepted", round=0, staleness=0)


def _copy(payload) -> bytes | np.ndarray:
    """A push's bytes in memory of their own."""
    if isinstance(payload, StagedSum):  # demoted: a whole push in its keep buffer
        payload = payload.payload()
    if isinstance(payload, buffers.SpilledPayload):
        return payload.read(slice(0, len(payload)))
    return payload.copy() if isinstance(payload, np.ndarray) else bytes(payload)


def _f32_owned(payload, numel: int, max_abs: float) -> np.ndarray:
    """An f32 payload within `max_abs` as a writable float32 array: the received
    buffer itself when the caller hands over a uint8 array it owns, else a copy."""
    codec.validate(payload, "f32", numel, max_abs)
    if isinstance(payload, np.ndarray) and payload.dtype == np.uint8 and \
            payload.flags.writeable and payload.flags.c_contiguous:
        return payload.view(np.float32)
    return codec.decode(payload, "f32", numel)
