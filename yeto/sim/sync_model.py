"""The synchronous data-parallel arm of the fleet-scale model (`yeto.sim.scale`): the
same fleet and failure trace as the DiLoCo arm, every step an all-reduce across the
islands in the group.

The model (elastic data-parallel, as torchft's: the group goes on without a failed
member instead of stopping the job):

- A step of group G takes max(the slowest member's step time, the all-reduce), both
  fixed when the step starts (compute and communication fully overlapped, which favours
  this arm). The all-reduce of `grad_bytes` per island: a bandwidth-optimal ring's
  2·(n−1)/n·grad_bytes over the slowest member link (divided by the slow-link factor
  while an episode covers the step's start), plus a tree's 2·⌈log2 n⌉ latencies: the
  better term of each, again in this arm's favour.
- A member that crashes during a step: the step's work is lost for every member; the
  group stalls until the crash is detected (`detect_s`) and re-forms without it
  (`reform_s`). A crash during a stall extends it to its own detection plus a re-form.
- An island back from its restart joins at the next step boundary: the group re-forms
  (`reform_s`, everyone waits); islands back while the group is stalled join in that
  re-form at no extra cost. Its state arrives from a peer meanwhile (not counted).

Useful island-steps: the members of each completed step, one step each. Paid: every
island's time at its nominal speed (`Fleet.paid_steps`), the same as the DiLoCo arm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from yeto.sim.trace import FailureTrace, Fleet


@dataclass(frozen=True)
class SyncConfig:
    grad_bytes: int          # per island per step (e.g. bf16 gradients: 2 × params)
    detect_s: float = 20.0
    reform_s: float = 30.0

    def __post_init__(self):
        if self.grad_bytes < 0 or self.detect_s < 0 or self.reform_s < 0:
            raise ValueError("gradient bytes, detection and re-form times must be >= 0")


@dataclass
class SyncOutcome:
    seconds: float
    paid_steps: float
    useful_steps: float = 0.0
    steps: int = 0                 # completed steps of the group
    lost_steps: float = 0.0        # island-steps of steps a crash cut short
    stalled_s: float = 0.0         # seconds the group waited for detection and re-forms
    reforms: int = 0

    @property
    def goodput(self) -> float:
        return self.useful_steps / self.paid_steps


class SyncModel:
    """One run of the synchronous arm over `seconds`; `run()` once."""

    def __init__(self, cfg: SyncConfig, fleet: Fleet, trace: FailureTrace, seconds: float):
        if len(trace.crashes) != fleet.islands:
            raise ValueError(f"the trace has {len(trace.crashes)} islands, the fleet "
                             f"{fleet.islands}")
        self.cfg, self.fleet, self.trace, self.seconds = cfg, fleet, trace, float(seconds)
        self.out = SyncOutcome(self.seconds, fleet.paid_steps(self.seconds))
        # the trace as one time-ordered list: (time, order, kind, island)
        ev = []
        for i, spans in enumerate(trace.crashes):
            for down, up in spans:
                ev += [(down, 0, "crash", i), (up, 1, "up", i)]
        for i, spans in enumerate(trace.slow):
            for a, b in spans:
                ev += [(a, 2, "slow", i), (b, 2, "fast", i)]
        self.events = sorted(ev)
        self.member = np.ones(fleet.islands, dtype=bool)
        self.slow = np.ones(fleet.islands)
        self.t, self.k, self.stall_end = 0.0, 0, 0.0  # now, the next event, stalled until
        self.joiners: set[int] = set()                 # back, waiting to be let in
        self.d = self.step_seconds()                    # the next step's duration

    def step_seconds(self) -> float:
        """The duration of a step that starts now, for the group as it is."""
        m = self.member
        n = int(m.sum())
        if n == 0:
            return math.inf
        compute = float(self.fleet.step_s[m].max())
        if n == 1:
            return compute
        bw = float((self.fleet.bandwidth[m] / self.slow[m]).min())
        comm = (2 * (n - 1) / n * self.cfg.grad_bytes / bw
                + 2 * math.ceil(math.log2(n)) * float(self.fleet.latency[m].max()))
        return max(compute, comm)

    def run(self) -> SyncOutcome:
        while self.t < self.seconds:
            if self.stall_end > self.t:
                self._stall()
            elif self.joiners:  # at a step boundary: re-form to let them in
                self.out.reforms += 1
                self.stall_end = self.t + self.cfg.reform_s
            elif math.isinf(self.d):  # nobody in the group: wait for the next event
                if self.k == len(self.events):
                    break
                at, _, kind, i = self.events[self.k]
                self.k += 1
                self.t = max(self.t, at)
                self._note(kind, i)
            else:
                self._step()
        return self.out

    def _stall(self) -> None:
        """Detection and re-form until `stall_end`; a member's crash meanwhile extends it,
        and islands back meanwhile join in it."""
        ev, cfg = self.events, self.cfg
        while self.k < len(ev) and ev[self.k][0] < self.stall_end:
            at, _, kind, i = ev[self.k]
            self.k += 1
            if kind == "crash" and self.member[i]:
                self.member[i] = False
                self.stall_end = max(self.stall_end, at + cfg.detect_s + cfg.reform_s)
            else:
                self._note(kind, i)
        self.out.stalled_s += min(self.stall_end, self.seconds) - self.t
        self.t = self.stall_end
        self.member[list(self.joiners)] = True
        self.joiners.clear()
        self.d = self.step_seconds()

    def _step(self) -> None:
        """One step [t, t + d): cut short by a member's crash, else done."""
        ev, done = self.events, self.t + self.d
        while self.k < len(ev) and ev[self.k][0] < done:
            at, _, kind, i = ev[self.k]
            self.k += 1
            if kind == "crash" and self.member[i]:
                self.out.lost_steps += float(self.member.sum())
                self.member[i] = False
                self.out.reforms += 1
                self.stall_end = at + self.cfg.detect_s + self.cfg.reform_s
                self.t = at
                return
            self._note(kind, i)
        if done <= self.seconds:
            self.out.useful_steps += float(self.member.sum())
            self.out.steps += 1
        self.t = done
        self.d = self.step_seconds()

    def _note(self, kind: str, i: int) -> None:
        """An event that does not stop the group: a non-member's crash (an island back
        but not yet let in), an island back, a link slowing or recovering."""
        if kind == "crash":
            self.joiners.discard(i)
        elif kind == "up":
            self.joiners.add(i)
        elif kind == "slow":
            self.slow[i] = self.trace.slow_factor
        elif kind == "fast":
            self.slow[i] = 1.0
