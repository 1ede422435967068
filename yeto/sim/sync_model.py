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
        out, cfg, end = self.out, self.cfg, self.seconds
        ev, k = self.events, 0
        t, joiners, stall_end = 0.0, set(), 0.0
        d = self.step_seconds()
        while t < end:
            if stall_end > t:  # detection and re-form: events meanwhile extend it
                while k < len(ev) and ev[k][0] < stall_end:
                    at, _, kind, i = ev[k]
                    k += 1
                    if kind == "crash" and self.member[i]:
                        self.member[i] = False
                        stall_end = max(stall_end, at + cfg.detect_s + cfg.reform_s)
                    elif kind == "crash":
                        joiners.discard(i)  # crashed again before it joined
                    else:
                        self._other(kind, i, joiners)
                out.stalled_s += min(stall_end, end) - t
                t = stall_end
                self.member[list(joiners)] = True  # joined in the re-form
                joiners.clear()
                d = self.step_seconds()
                continue
            if joiners:  # at a step boundary: re-form to let them in
                out.reforms += 1
                stall_end = t + cfg.reform_s
                continue
            if math.isinf(d):  # nobody in the group: wait for the next event
                if k == len(ev):
                    break
                at, _, kind, i = ev[k]
                k += 1
                t = max(t, at)
                if kind == "crash":
                    joiners.discard(i)
                else:
                    self._other(kind, i, joiners)
                continue
            # one step [t, t + d): cut short by a member's crash, else done
            done = t + d
            while k < len(ev) and ev[k][0] < done:
                at, _, kind, i = ev[k]
                k += 1
                if kind == "crash" and self.member[i]:
                    out.lost_steps += float(self.member.sum())
                    self.member[i] = False
                    out.reforms += 1
                    stall_end = at + cfg.detect_s + cfg.reform_s
                    t = at
                    break
                if kind == "crash":
                    joiners.discard(i)  # crashed again before it joined
                else:
                    self._other(kind, i, joiners)
            else:
                if done <= end:
                    out.useful_steps += float(self.member.sum())
                    out.steps += 1
                t = done
                d = self.step_seconds()
        return out

    def _other(self, kind: str, i: int, joiners: set) -> None:
        if kind == "up":
            joiners.add(i)
        elif kind == "slow":
            self.slow[i] = self.trace.slow_factor
        elif kind == "fast":
            self.slow[i] = 1.0
