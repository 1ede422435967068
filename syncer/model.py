"""The run's model: the layout every island trains, Θ, the outer optimizer's state (the
momentum m and each fragment's step count), which island seeds Θ, and the files the
final weights are written as. `Model` alone changes them; callers hold the run's lock.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from syncer import state, strategy
from syncer.bounds import SEED_MAX_ABS
from syncer.errors import Reject
from syncer.merge import MergeAccumulator
from syncer.staging import OwnedSeed
from yeto import codec
from yeto.layout import Layout, LayoutMismatch, TensorSpec

if TYPE_CHECKING:
    import hashlib

log = logging.getLogger("syncer")

# a file the syncer writes into final/ for an island: a bare name, never a path
FILE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


@dataclass
class Restored:
    """What a saved state gives the model back."""

    layout: Layout
    theta: np.ndarray
    momentum: np.ndarray | None
    outer_steps: dict[int, int]
    weights_file: str
    export_files: dict[str, str]


class Model:
    """Θ and what the outer step keeps beside it, over the run's layout."""

    def __init__(self, fragments: int, outer: strategy.Nesterov, seed_from: str = ""):
        self.fragments = fragments
        self.outer = outer
        self.layout: Layout | None = None
        self.weights_file = "weights.safetensors"
        self.export_files: dict[str, str] = {}
        self.theta: np.ndarray | None = None
        self.m: np.ndarray | None = None  # the outer momentum, kept only when it is used
        self.outer_steps: dict[int, int] = {}  # per fragment: outer steps taken
        self.seed_from = seed_from  # the operator's choice (--seed-from); "" for none
        self.seeder = seed_from  # who is asked for the seed (set at the first join)
        self.seed_sha256 = b""  # the digest of the seed's payload, once Θ is seeded
        self.refused_seeders: set[str] = set()  # islands whose seed was refused

    # ---- what islands bring ---------------------------------------------------------
    def adopt(self, learner_id: str, layout: Layout, weights_file: str,
              export_files: dict[str, str], observer: bool) -> bool:
        """The first training island's layout (and output files) become the run's;
        every later one must match it. An observer's layout is checked against the
        run's and never becomes it. Returns whether `layout` became the run's now. A
        refusal changes nothing."""
        checked_files(learner_id, weights_file, export_files)
        if self.layout is not None:
            try:
                self.layout.check_same(layout)
            except LayoutMismatch as e:
                raise Reject("precondition", f"{learner_id} cannot join: "
                             f"{differing_setting(self.layout.specs, layout.specs)} ({e}). "
                             "Every island must train the same model with the same "
                             "--lora-r/--lora-targets/--tuning (one run file, --config, keeps "
                             "them equal); check with `yeto check-parity`") from None
        if observer:
            return False
        if self.layout is None or not self.export_files:
            self.weights_file = weights_file or self.weights_file
            self.export_files = dict(export_files)
        if self.layout is None:
            self.layout = layout
            return True
        return False

    def choose_seeder(self, learner_id: str) -> None:
        """A training island joined: the first one seeds Θ unless --seed-from names one
        (an island whose seed was refused is never asked again)."""
        if not self.seeder and learner_id not in self.refused_seeders:
            self.seeder = learner_id

    def seed_refused(self, learner_id: str, joiners: list[tuple[str, bytes]]) -> bool:
        """The seeder's seed was refused (not the weights it declared, or not finite
        and in range): it is not asked again; the next of `joiners` (learner id,
        declared digest; in join order) that declared the same initial weights is, else
        the next to join. Returns whether the seeder changed (--seed-from's stays)."""
        if learner_id != self.seeder or self.seed_from:
            return False
        self.refused_seeders.add(learner_id)
        declared = dict(joiners).get(learner_id, b"")
        self.seeder = next((lid for lid, d in joiners if d == declared and
                            lid not in self.refused_seeders), "")
        return True

    def seeder_gone(self, learner_id: str) -> None:
        """An island left: if it was to seed Θ and has not, the next to join seeds it."""
        if self.theta is None and self.seeder == learner_id and not self.seed_from:
            self.seeder = ""

    def asks_seed_of(self, learner_id: str) -> bool:
        return self.theta is None and learner_id == self.seeder

    def seed_target(self, owned: list[int] | None) -> OwnedSeed | None:
        """Where a shard receives a seed (`owned`: its fragments; None: all, then the
        seed arrives whole): only its own fragments' values are kept as they come."""
        if owned is None or len(owned) == self.fragments:
            return None
        return OwnedSeed(self.the_layout.numel, [self.span(f) for f in owned])

    def seed(self, learner_id: str, payload: codec.Payload | OwnedSeed, declared: bytes = b"",
             owned: list[int] | None = None) -> bool:
        """Θ from the seeding island's initial weights (False: Θ was seeded already; a
        seed from any other island is refused, and so is one that is not the initial
        weights the island `declared` at its join). `owned`: the fragments this syncer
        runs (a shard's; None: all): only their values are kept (a shard's seed arrives
        as an `OwnedSeed` that kept only those)."""
        if self.theta is not None:
            return False
        if learner_id != self.seeder:
            raise Reject("precondition", f"{learner_id} was not asked for the seed: "
                         f"{self.seeder or 'the first island to join'} seeds Θ (the syncer's "
                         "--seed-from names it)")
        if isinstance(payload, OwnedSeed):  # its values checked as they arrived
            theta, digest = payload.theta, payload.digest()
        else:
            try:  # (a push header is refused before the layout)
                theta = _f32_owned(payload, self.the_layout.numel, SEED_MAX_ABS)
            except codec.CodecError as e:
                raise Reject("invalid", f"seed from {learner_id} rejected: {e}") from None
            digest = hashlib.sha256(theta.data).digest()
        if declared and digest != declared:
            raise Reject("invalid", f"the seed from {learner_id} (sha256 {digest.hex()[:12]}) "
                         "is not the initial weights it declared when it joined (sha256 "
                         f"{declared.hex()[:12]}): Θ stays unseeded")
        kept = theta if isinstance(payload, OwnedSeed) else self._owned_only(theta, owned)
        self.theta, self.seed_sha256 = kept, digest
        if self.outer.keeps_momentum:
            self.m = np.zeros(theta.shape, theta.dtype)
        log.info("Θ seeded by %s (%d parameters)", learner_id, theta.size)
        return True

    def vote(self, joiners: list[tuple[str, bytes]]) -> str:
        """The first quorum's check of the seed, before round 1: when more than half of
        the `joiners` (learner id, declared digest of its initial weights; in the order
        they joined) that declared one agree on initial weights other than Θ's, Θ is
        unseeded and the earliest of them is asked for it instead. Returns what changed
        ("": nothing). --seed-from's choice stands; so does Θ when no majority agrees
        (islands that start from different weights, e.g. torch beside MLX)."""
        declared = [(lid, d) for lid, d in joiners if d]
        if not self.seed_sha256 or self.seed_from or not declared:
            return ""  # unseeded, or Θ restored from the state dir, or the operator's seed
        counts = collections.Counter(d for _, d in declared)
        digest, n = counts.most_common(1)[0]
        if 2 * n <= len(declared) or digest == self.seed_sha256:
            return ""
        before = self.seeder
        self.seeder = next((lid for lid, d in declared if d == digest and
                            lid not in self.refused_seeders), "")
        self.theta, self.m, self.seed_sha256 = None, None, b""
        return (f"{n} of the {len(declared)} islands of the first quorum declared initial "
                f"weights (sha256 {digest.hex()[:12]}) other than the seed {before} sent: "
                f"Θ is unseeded, and {self.seeder} seeds it")

    def note_island(self, learner_id: str, regime: str) -> str:
        """An island joined with `regime`; what changed in the outer rule ("": nothing)."""
        return self.outer.note_island(learner_id, regime) or ""

    # ---- the outer step -------------------------------------------------------------
    def span(self, f: int) -> tuple[int, int]:
        frag = self.the_layout.fragments[f]
        return frag.start, frag.stop

    def spans(self) -> list[tuple[int, int]]:
        return [self.span(f) for f in range(self.fragments)]

    def numel(self, f: int | None = None) -> int:
        """Values in fragment f (None: in Θ)."""
        return self.the_layout.numel if f is None else self.the_layout.fragments[f].numel

    @property
    def the_layout(self) -> Layout:
        if self.layout is None:
            raise RuntimeError("the run has no layout yet")
        return self.layout

    @property
    def the_theta(self) -> np.ndarray:
        if self.theta is None:
            raise RuntimeError("Θ is not seeded yet")
        return self.theta

    @property
    def momentum(self) -> np.ndarray | None:
        """The outer momentum m (zeros made on request when the run keeps none)."""
        if self.m is None and self.theta is not None:
            return np.zeros(self.theta.shape, self.theta.dtype)
        return self.m

    def outer_step(self, f: int, acc: MergeAccumulator,
                   on_chunk: Callable[[int, int], None] | None = None
                   ) -> tuple[np.ndarray | None, int]:
        """Step fragment f's slice of Θ (and of m) by `acc`'s merged pseudo-gradient:
        (the round's sum buffer, the step number). Counted once `stepped` says so."""
        lo, hi = self.span(f)
        m = None if self.m is None else self.m[lo:hi]
        t = self.outer_steps.get(f, 0) + 1
        return acc.step_outer(self.outer, self.the_theta[lo:hi], m, t, on_chunk=on_chunk), t

    def stepped(self, f: int, t: int) -> None:
        self.outer_steps[f] = t

    def steps(self, f: int) -> int:
        return self.outer_steps.get(f, 0)

    # ---- on disk --------------------------------------------------------------------
    def _owned_only(self, theta: np.ndarray, owned: list[int] | None) -> np.ndarray:
        """`theta`, or for a shard a new Θ holding only its own fragments' values: the
        pages of the others are never written, so they take no memory (`np.zeros`
        maps pages on first write; `np.zeros_like` would write them all)."""
        if owned is None or len(owned) == self.fragments:
            return theta
        kept = np.zeros(theta.shape, theta.dtype)
        for f in owned:
            lo, hi = self.span(f)
            kept[lo:hi] = theta[lo:hi]
        return kept

    def restore(self, saved: Restored, owned: list[int] | None = None) -> None:
        """The model as saved; `owned` as for `seed`."""
        self.layout = saved.layout
        self.theta = self._owned_only(saved.theta, owned)
        if self.outer.keeps_momentum:
            self.m = np.zeros(self.theta.shape, self.theta.dtype) if saved.momentum is None else \
                self._owned_only(saved.momentum, owned)
        self.outer_steps = dict(saved.outer_steps)
        self.weights_file, self.export_files = saved.weights_file, dict(saved.export_files)

    def record(self) -> dict[str, Any]:
        """What the state file keeps of the model beside its arrays."""
        layout = self.the_layout
        return dict(fingerprint=layout.fingerprint,
                    layout=[[s.name, list(s.shape), s.dtype] for s in layout.specs],
                    outer_steps={str(f): t for f, t in self.outer_steps.items()},
                    weights_file=self.weights_file, export_files=self.export_files)

    def provenance(self) -> dict[str, Any]:
        """What provenance.json says of the final weights."""
        return dict(weights_file=self.weights_file, theta_sha256=state.digest(self.the_theta),
                    fingerprint=self.the_layout.fingerprint,
                    parameters=int(self.the_layout.numel))

    def digest_into(self, h: hashlib._Hash) -> None:
        for a in (self.theta, self.m):
            h.update(b"-" if a is None else a.data.cast("B"))


def checked_files(learner_id: str, weights_file: str, export_files: dict[str, str]) -> None:
    """The names of the files an island asks the syncer to write into `final/`: each a
    bare file name (no folder, no `..`, no absolute path), none of them the same file
    as another or as provenance.json. Checked before anything is adopted."""
    names = [weights_file, *export_files] if weights_file else list(export_files)
    for name in names:
        if not FILE_NAME.fullmatch(name):
            raise Reject("invalid", f"{learner_id}: output file name {name[:80]!r} is not a "
                                    "bare file name (letters, digits, '.', '_', '-'; at most "
                                    "128 characters, not starting with '.')")
    lowered = [n.lower() for n in names]  # one file on a case-insensitive disk
    if len(set(lowered)) != len(lowered) or "provenance.json" in lowered:
        raise Reject("invalid", f"{learner_id}: output files {sorted(names)} name one file "
                                "twice (or provenance.json, which the syncer writes)")


def differing_setting(run: Iterable[TensorSpec], island: Iterable[TensorSpec]) -> str:
    """Which shared setting two layouts disagree on, in the words of the flags."""
    def lora(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
        return [s for s in specs if ".lora_A." in s.name]
    if bool(lora(run)) != bool(lora(island)):
        return ("--tuning differs: the run trains "
                f"{'LoRA adapters' if lora(run) else 'full weights'}, this island "
                f"{'LoRA adapters' if lora(island) else 'full weights'}")
    ranks = {s.shape[0] for s in lora(run)}, {s.shape[0] for s in lora(island)}
    if lora(run) and ranks[0] != ranks[1]:
        return (f"the LoRA rank differs (--lora-r, [lora] r): the run has "
                f"{'/'.join(map(str, sorted(ranks[0])))}, this island "
                f"{'/'.join(map(str, sorted(ranks[1])))}")
    names = {s.name for s in run}, {s.name for s in island}
    if lora(run) and names[0] != names[1]:
        return "the LoRA targets differ (--lora-targets, [lora] targets)"
    return "the model differs (--model, [run] model: another architecture or size)"



def _f32_owned(payload: codec.Payload, numel: int, max_abs: float) -> np.ndarray:
    """An f32 payload within `max_abs` as a writable float32 array: the received
    buffer itself when the caller hands over a uint8 array it owns, else a copy."""
    codec.validate(payload, "f32", numel, max_abs)
    if isinstance(payload, np.ndarray) and payload.dtype == np.uint8 and \
            payload.flags.writeable and payload.flags.c_contiguous:
        return payload.view(np.float32)
    return codec.decode(payload, "f32", numel)
