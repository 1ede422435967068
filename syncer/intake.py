"""What a push header must meet before any of its payload is read: encoding, size,
round and claims. Checks only: they read what they are given and change nothing (the
run calls them under its lock, `syncer.run.Run.push`)."""

from __future__ import annotations

from syncer.bounds import SEED_MAX_ABS, BoundError, Bounds
from syncer.errors import Reject
from syncer.members import Member
from syncer.messages import PushHeader
from yeto import codec


def payload_size(h: PushHeader, numel: int) -> int:
    """The payload size a header for a fragment (or seed) of `numel` values must
    declare, checked against its encoding and what it says."""
    if h.encoding not in codec.ENCODINGS:
        raise Reject("invalid", f"unknown encoding {h.encoding!r}; "
                     f"use one of {', '.join(codec.ENCODINGS)}")
    if h.numel != numel:
        what = "Θ" if h.seed else f"fragment {h.fragment}"
        raise Reject("invalid", f"push has {h.numel} elements, {what} has {numel}")
    want = codec.encoded_size(h.encoding, h.numel)
    if h.payload_bytes != want:
        raise Reject("invalid", f"{h.encoding} payload for {h.numel} elements must be "
                     f"{want} bytes, header says {h.payload_bytes}")
    if h.seed and h.encoding != "f32":
        raise Reject("invalid", "the seed must be sent in f32")
    return want


def fragment(h: PushHeader, fragments: int) -> int:
    """The fragment a delta names, if the run has it."""
    if h.fragment >= fragments:
        raise Reject("invalid", f"fragment {h.fragment} does not exist (the run has "
                     f"{fragments})")
    return h.fragment


def owner(h: PushHeader, owners: list[int], shard: int) -> None:
    """A delta goes to the shard that owns its fragment."""
    if owners[h.fragment] != shard:
        raise Reject("invalid", f"fragment {h.fragment} belongs to shard {owners[h.fragment]}, "
                     f"this syncer is shard {shard}: push it there (the island's --syncer "
                     "lists the shards in order, separated by ';')")


def round_open(h: PushHeader, started: bool, finished: bool, version: int) -> None:
    """A delta needs a round open on a version the syncer has."""
    if finished:
        raise Reject("precondition", "the run has finished")
    if not started:
        raise Reject("precondition", "round 1 has not started (waiting for quorum)")
    if h.base_version > version:
        raise Reject("invalid", f"base version {h.base_version} is newer than the "
                     f"syncer's {version}")


def claims(bounds: Bounds, member: Member, h: PushHeader, commits: list[int],
           now: float) -> None:
    """The loss tokens and steps a delta claims, within what its island declared, the
    rounds it may be carrying (`commits`: its fragment's commit versions) and the wall
    time it had (`now`: the run's clock)."""
    try:
        bounds.claims(h.loss_tokens, h.steps, member.tokens_per_step, member.sync_every,
                      member.missed(h.fragment, commits), member.trained_for(h.fragment, now))
    except BoundError as e:
        raise Reject("invalid", f"{h.learner_id}: {e}") from None


def round_matches(h: PushHeader) -> None:
    if h.round != h.base_version + 1:
        raise Reject("invalid", f"push for round {h.round} against base version "
                     f"{h.base_version}: a push joins round base_version + 1")


def max_abs(h: PushHeader, bounds: Bounds) -> float:
    """The value bound of a push's elements (syncer.bounds): the seed's or a delta's."""
    return SEED_MAX_ABS if h.seed else bounds.max_delta
