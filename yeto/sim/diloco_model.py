"""The DiLoCo arm of the fleet-scale model (`yeto.sim.scale`): a discrete-event model
of k islands pushing fragments to S syncer shards, on simulated seconds, no model and
no bytes (an event heap; broadcasts computed for every island at once with numpy).

What it follows from the real code:

- **Schedule** (`yeto.island.schedule.Schedule`, called for one cycle of H steps):
  fragment f is due every H steps, offset by (f+1)·H/F.
- **Pipeline** (`yeto.island.Island._room_for`): an island pushes fragment f only when
  f is not in flight and fewer than `pipeline` fragments are; it waits (stalls, not
  training) otherwise. A push stays in flight until the island applies a broadcast of
  its fragment made after the push was sent, or until it is refused
  (`yeto.island.ledger.PushLedger`).
- **Pacing** (`syncer.pacing.Pacing` and `OpenRound`, used as they are): a fragment's
  round commits at once when every live island has pushed, at quorum K plus the grace
  window (`fixed`: `grace_ms`; `auto`: `syncer.grace.AutoGrace`), or `round_timeout_s`
  after its first push. The model asks `Pacing.reason` when a push arrives that could
  complete the round, and at each deadline `Pacing.deadlines` gives; with `auto` grace
  the wait is therefore computed at the quorum and at the deadlines, where the real
  syncer asks again on every tick (a round can commit a little later here).
- **Staleness** (`syncer.rounds.Rounds.staleness`): a push whose base version is more
  than `max_staleness` commits behind is refused; the island carries its steps into its
  next push of that fragment (`PushLedger`), as the real island does.
- **Shards** (`syncer.shards.owners`): fragments are dealt to S shards by parameter
  count; each shard owns its fragments' rounds and broadcasts.
- **Crashes**: a crashed island loses its steps not yet held by a shard (since each
  fragment's last push, work carried from refusals, pushes still on the wire); pushes
  that arrived stay in their rounds. The syncer counts it live until `detect_s` after
  the crash (keepalive). At its restart it joins again (live at once), downloads the
  whole Θ in f32 from every shard, and trains from step 0 of its schedule.

Links and shards:

- an island's transfer of B bytes started at t takes B / (its bandwidth, divided by the
  slow-link factor if an episode covers t) plus its latency; its transfers do not
  queue behind one another;
- a shard (`ShardLink`) is its NIC, a FIFO server per direction, and its CPU, one FIFO
  server for both directions at `shard_cores / cpu_s_per_byte` bytes per second; a push
  of B bytes holds the NIC's up-direction and the CPU for B bytes; a broadcast to n
  islands holds the down-direction and the CPU for n·B bytes (fair share: every copy is
  delivered at the end); a transfer is done when its island link and the shard are,
  plus the latency;
- shard CPU seconds = bytes in and out × `cpu_s_per_byte` (a measured constant), of
  the work done by the end of the run (an overloaded shard's queue is its backlog).

Useful island-steps: every inner step an island makes and does not lose to a crash.
Steps merged into Θ, in rounds still open, in pushes in flight or refused and carried
(a refused push's work goes into the next push), or held on an island at the end
(whose finish pushes it) are all useful. Waste: time down and re-joining, time stalled
on the pipeline, and steps lost to crashes.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from syncer.merge import MergeAccumulator
from syncer.pacing import OpenRound, Pacing
from syncer.shards import owners
from yeto.codec import encoded_size
from yeto.island.schedule import Schedule
from yeto.sim.trace import FailureTrace, Fleet

INF = math.inf
KEEP_BROADCASTS = 8  # per fragment: how many recent broadcasts' delivery times are kept

# event kinds (ties at one time go in the order the events were made)
DUE, RETRY, ARRIVE, CHECK, CRASH, UP, READY, DETECT, SLOW_ON, SLOW_OFF = range(10)
DOWN, JOINING, TRAINING = range(3)  # an island's state


@dataclass(frozen=True)
class DiLoCoConfig:
    """The run: `params` f32 values in `fragments` size-balanced fragments over `shards`
    syncer shards; islands push q4 every `sync_every` (H) steps; broadcasts go out in
    `downlink` encoding; `quorum` is K islands (an int, as the syncer's `--quorum`)."""

    params: int
    fragments: int
    sync_every: int
    quorum: int
    shards: int = 1
    pipeline: int = 1
    downlink: str = "f32"
    grace: str = "auto"
    grace_ms: int = 500
    round_timeout_s: float = 600.0
    max_staleness: int = 1
    detect_s: float = 20.0
    shard_nic_bps: float = 3.125e9     # bytes per second each way (25 Gbit/s)
    shard_cores: float = 1.0
    cpu_s_per_byte: float = 0.0

    def __post_init__(self):
        if self.params < self.fragments or self.fragments < 1:
            raise ValueError("need 1 <= fragments <= params")
        if self.shards < 1 or self.shards > self.fragments:
            raise ValueError(f"{self.shards} shards need at least as many fragments "
                             f"(got {self.fragments}); raise --fragments")
        if self.sync_every < 1 or self.pipeline < 1 or self.quorum < 1:
            raise ValueError("sync_every, pipeline and quorum must be >= 1")
        if self.grace not in ("auto", "fixed"):
            raise ValueError("grace is 'auto' or 'fixed'")
        if self.shard_nic_bps <= 0 or self.shard_cores <= 0 or self.cpu_s_per_byte < 0:
            raise ValueError("shard NIC bandwidth and cores must be > 0, CPU per byte >= 0")

    @property
    def shard_cpu_bps(self) -> float:
        """Bytes per second (in and out together) one shard's CPU can move."""
        return self.shard_cores / self.cpu_s_per_byte if self.cpu_s_per_byte else INF

    def numels(self) -> list[int]:
        """Fragment sizes: contiguous, size-balanced (the first P mod F one larger)."""
        q, r = divmod(self.params, self.fragments)
        return [q + (f < r) for f in range(self.fragments)]


@dataclass
class ShardLink:
    """One shard: its NIC, a FIFO server per direction at `nic_bps` bytes per second, and
    its CPU, one FIFO server for both directions at `cpu_bps` bytes per second. A
    transfer is through the shard when both its NIC direction and the CPU are done.
    `bytes_in`, `bytes_out` and `cpu_s` count what the CPU has done by `end` (a
    transfer the CPU is partway through at `end` counts in part); `backlog_s` is the
    work queued beyond `end`."""

    nic_bps: float
    cpu_bps: float = INF
    end: float = INF
    up_free: float = 0.0
    down_free: float = 0.0
    cpu_free: float = 0.0
    bytes_in: float = 0.0
    bytes_out: float = 0.0

    def receive(self, t: float, nbytes: int) -> float:
        """A transfer of `nbytes` to the shard, started at `t`: when the shard has it."""
        self.up_free = max(t, self.up_free) + nbytes / self.nic_bps
        cpu, done = self._cpu(t, nbytes)
        self.bytes_in += done
        return max(self.up_free, cpu)

    def send(self, t: float, nbytes: int) -> float:
        """`nbytes` from the shard, queued at `t`: when the last byte has left."""
        self.down_free = max(t, self.down_free) + nbytes / self.nic_bps
        cpu, done = self._cpu(t, nbytes)
        self.bytes_out += done
        return max(self.down_free, cpu)

    def _cpu(self, t: float, nbytes: int) -> tuple[float, float]:
        """The CPU's end of this transfer, and the bytes of it done by `end`."""
        start = max(t, self.cpu_free)
        self.cpu_free = start + nbytes / self.cpu_bps
        if self.cpu_free <= self.end:
            return self.cpu_free, float(nbytes)
        if start >= self.end:
            return self.cpu_free, 0.0
        return self.cpu_free, nbytes * (self.end - start) / (self.cpu_free - start)

    @property
    def backlog_s(self) -> float:
        return max(0.0, max(self.up_free, self.down_free, self.cpu_free) - self.end)


@dataclass
class DiLoCoOutcome:
    seconds: float
    paid_steps: float
    made_steps: float = 0.0
    lost_steps: float = 0.0           # made, then lost to crashes
    stalled_steps: float = 0.0        # island-seconds stalled on the pipeline, in steps
    rejoin_steps: float = 0.0         # downloading Θ after a restart, in steps
    down_steps: float = 0.0           # down, in steps
    pushes: int = 0
    refused: int = 0                  # more than max_staleness behind: carried forward
    stale_accepted: int = 0
    commits: Counter = field(default_factory=Counter)  # by reason
    round_s: float = math.nan         # a fragment's mean time between commits
    shard_bytes_in: list[float] = field(default_factory=list)   # by the end
    shard_bytes_out: list[float] = field(default_factory=list)
    shard_cpu_s: list[float] = field(default_factory=list)
    shard_backlog_s: list[float] = field(default_factory=list)  # queued past the end

    @property
    def useful_steps(self) -> float:
        return self.made_steps - self.lost_steps

    @property
    def goodput(self) -> float:
        return self.useful_steps / self.paid_steps


@dataclass(slots=True)
class _Push:
    island: int
    fragment: int
    steps: int
    base: int


class DiLoCoModel:
    """One run of the DiLoCo arm over `seconds` of simulated time; `run()` once."""

    def __init__(self, cfg: DiLoCoConfig, fleet: Fleet, trace: FailureTrace, seconds: float):
        if len(trace.crashes) != fleet.islands:
            raise ValueError(f"the trace has {len(trace.crashes)} islands, the fleet "
                             f"{fleet.islands}")
        if cfg.quorum > fleet.islands:
            raise ValueError(f"quorum {cfg.quorum} is more than the {fleet.islands} islands")
        self.cfg, self.fleet, self.trace, self.seconds = cfg, fleet, trace, float(seconds)
        n, nf = fleet.islands, cfg.fragments
        numels = cfg.numels()
        self.owner = owners(numels, cfg.shards)
        self.up_bytes = [encoded_size("q4", m) for m in numels]
        self.down_bytes = [encoded_size(cfg.downlink, m) for m in numels]
        self.join_bytes = [sum(4 * m for f, m in enumerate(numels) if self.owner[f] == s)
                           for s in range(cfg.shards)]
        self.shards = [ShardLink(cfg.shard_nic_bps, cfg.shard_cpu_bps, self.seconds)
                       for _ in range(cfg.shards)]
        sched = Schedule(cfg.sync_every)
        self.cycle = [(s, sched.due(s, nf)) for s in range(1, cfg.sync_every + 1)]
        self.cycle = [(s, fs) for s, fs in self.cycle if fs]
        self.pacing = Pacing(cfg.quorum, cfg.grace, cfg.grace_ms, cfg.round_timeout_s)
        # islands
        self.step_s = fleet.step_s.tolist()
        self.bw = fleet.bandwidth.astype(float)   # arrays for broadcasts, lists for one island
        self.lat = fleet.latency.astype(float)
        self.slow = np.ones(n)
        self.bw_l, self.lat_l, self.slow_l = self.bw.tolist(), self.lat.tolist(), [1.0] * n
        self.state = [TRAINING] * n
        self.gen = [0] * n              # a new process at each restart
        self.tick = [0] * n             # the due point an island's DUE/RETRY events are for
        self.step = [0] * n             # steps since it joined, at t_acc
        self.t_acc = [0.0] * n          # when it last resumed training (or joined again)
        self.pos = [0] * n              # its next due point in `cycle`
        self.cyc = [0] * n              # cycles of H steps completed
        self.sub = [0] * n              # fragments of the due point pushed so far
        self.waiting = [False] * n
        self.wait_from = [0.0] * n
        self.join_from = [0.0] * n
        self.last_push = [[0] * nf for _ in range(n)]
        self.carried = [[0] * nf for _ in range(n)]
        self.known = [[0] * nf for _ in range(n)]        # version downloaded at (re)join
        self.inflight: list[dict[int, list[float]]] = [{} for _ in range(n)]  # f -> [sent, clear]
        self.wire: list[set[int]] = [set() for _ in range(n)]  # pushes not arrived yet
        # syncer
        self.live: set[int] = set(range(n))
        self.version = [0] * nf
        self.serial = [0] * nf
        self.open = [self._round(f) for f in range(nf)]
        self.recent: list[deque] = [deque(maxlen=KEEP_BROADCASTS) for _ in range(nf)]
        self.by_frag: list[set[int]] = [set() for _ in range(nf)]  # islands with f in flight
        self.commit_times: list[list[float]] = [[] for _ in range(nf)]
        self.pushes: list[_Push] = []
        self.out = DiLoCoOutcome(self.seconds, fleet.paid_steps(self.seconds))
        self._heap: list = []
        self._seq = itertools.count()

    # ---- the loop ---------------------------------------------------------------
    def run(self) -> DiLoCoOutcome:
        for i in range(self.fleet.islands):
            self._at(self.cycle[0][0] * self.step_s[i], DUE, i, 0)
            for down, up in self.trace.crashes[i]:
                self._at(down, CRASH, i, up)
            for a, b in self.trace.slow[i]:
                self._at(a, SLOW_ON, i, 0)
                self._at(b, SLOW_OFF, i, 0)
        handlers = {DUE: self._due, RETRY: self._retry, ARRIVE: self._arrive,
                    CHECK: self._check, CRASH: self._crash, UP: self._up, READY: self._ready,
                    DETECT: self._detect, SLOW_ON: self._slow_on, SLOW_OFF: self._slow_off}
        heap, end = self._heap, self.seconds
        while heap and heap[0][0] < end:
            t, _, kind, a, b = heapq.heappop(heap)
            handlers[kind](t, a, b)
        self._finish()
        return self.out

    def _at(self, t: float, kind: int, a, b) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, a, b))

    # ---- islands ---------------------------------------------------------------------
    def _due(self, t: float, i: int, tick: int) -> None:
        """Island i's training reached its next due point."""
        if tick != self.tick[i] or self.state[i] != TRAINING:
            return
        due = self.cyc[i] * self.cfg.sync_every + self.cycle[self.pos[i]][0]
        self.out.made_steps += due - self.step[i]
        self.step[i] = due
        self._try_push(t, i)

    def _retry(self, t: float, i: int, tick: int) -> None:
        if tick == self.tick[i] and self.state[i] == TRAINING and self.waiting[i]:
            self._try_push(t, i)

    def _try_push(self, t: float, i: int) -> None:
        frags = self.cycle[self.pos[i]][1]
        while self.sub[i] < len(frags):
            f = frags[self.sub[i]]
            until = self._blocked_until(t, i, f)
            if until is not None:
                if not self.waiting[i]:
                    self.waiting[i], self.wait_from[i] = True, t
                if until < INF:
                    self._at(until, RETRY, i, self.tick[i])
                return  # else a broadcast or a refusal wakes it
            self._push(t, i, f)
            self.sub[i] += 1
        if self.waiting[i]:
            self.out.stalled_steps += (t - self.wait_from[i]) / self.step_s[i]
            self.waiting[i] = False
        self.sub[i] = 0
        self.pos[i] += 1
        if self.pos[i] == len(self.cycle):
            self.pos[i], self.cyc[i] = 0, self.cyc[i] + 1
        nxt = self.cyc[i] * self.cfg.sync_every + self.cycle[self.pos[i]][0]
        self.tick[i] += 1
        self.t_acc[i] = t
        self._at(t + (nxt - self.step[i]) * self.step_s[i], DUE, i, self.tick[i])

    def _blocked_until(self, t: float, i: int, f: int) -> float | None:
        """None when island i may push fragment f at t, else when it may (inf: unknown
        until a broadcast comes)."""
        fl = self.inflight[i]
        mine = fl.get(f)
        if mine is not None and mine[1] > t:
            return mine[1]
        if len(fl) < self.cfg.pipeline:
            return None  # room, whatever has cleared meanwhile
        for g in [g for g, (_, clear) in fl.items() if clear <= t]:
            del fl[g]
            self.by_frag[g].discard(i)
        if len(fl) >= self.cfg.pipeline:
            return sorted(c for _, c in fl.values())[len(fl) - self.cfg.pipeline]
        return None

    def _push(self, t: float, i: int, f: int) -> None:
        steps = self.step[i] - self.last_push[i][f] + self.carried[i][f]
        self.last_push[i][f], self.carried[i][f] = self.step[i], 0
        nbytes = self.up_bytes[f]
        link = t + nbytes * self.slow_l[i] / self.bw_l[i]
        shard = self.shards[self.owner[f]].receive(t, nbytes)
        pid = len(self.pushes)
        self.pushes.append(_Push(i, f, steps, self._version_at(t, i, f)))
        self.wire[i].add(pid)
        self.inflight[i][f] = [t, self._next_delivery(t, i, f)]
        self.by_frag[f].add(i)
        self.out.pushes += 1
        self._at(max(link, shard) + self.lat_l[i], ARRIVE, pid, 0)

    def _version_at(self, t: float, i: int, f: int) -> int:
        """The version of fragment f island i holds at t (its push's base version)."""
        known = self.known[i][f]
        for version, deliveries in reversed(self.recent[f]):
            if version <= known:
                break
            if deliveries[i] <= t:
                return version
        return known

    def _next_delivery(self, t: float, i: int, f: int) -> float:
        """When island i next applies a broadcast of f made before t (inf: none due)."""
        return min((d[i] for _, d in self.recent[f] if d[i] > t), default=INF)

    def _crash(self, t: float, i: int, up_at: float) -> None:
        if self.state[i] == TRAINING:
            if self.waiting[i]:
                self.out.stalled_steps += (t - self.wait_from[i]) / self.step_s[i]
                self.waiting[i] = False
            else:
                self._train_until(t, i)
            lost = sum(self.step[i] - self.last_push[i][f] + self.carried[i][f]
                       for f in range(self.cfg.fragments))
            lost += sum(self.pushes[p].steps for p in self.wire[i])
            self.out.lost_steps += lost / self.cfg.fragments
        elif self.state[i] == JOINING:
            self.out.rejoin_steps += (t - self.join_from[i]) / self.step_s[i]
        self.wire[i].clear()
        for g in self.inflight[i]:
            self.by_frag[g].discard(i)
        self.inflight[i].clear()
        self.state[i] = DOWN
        self.gen[i] += 1
        self.tick[i] += 1
        self._at(t + self.cfg.detect_s, DETECT, i, self.gen[i])
        self._at(up_at, UP, i, self.gen[i])

    def _train_until(self, t: float, i: int) -> None:
        """Count the whole steps island i made since it last resumed, up to t."""
        made = int((t - self.t_acc[i]) / self.step_s[i])
        nxt = self.cyc[i] * self.cfg.sync_every + self.cycle[self.pos[i]][0]
        made = min(made, nxt - self.step[i])
        self.out.made_steps += made
        self.step[i] += made
        self.t_acc[i] = t

    def _detect(self, t: float, i: int, gen: int) -> None:
        """The syncer stops counting a crashed island as live."""
        if gen != self.gen[i] or i not in self.live:
            return
        self.live.discard(i)
        for f, rnd in enumerate(self.open):
            if rnd.first_push_at is not None and len(rnd.learners) >= len(self.live):
                self._maybe_commit(t, f)

    def _up(self, t: float, i: int, gen: int) -> None:
        """Island i's restart is done: it joins again and downloads Θ (f32, every shard)."""
        if gen != self.gen[i]:
            return
        self.gen[i] += 1  # a new process: the old one's detection no longer applies
        self.live.add(i)
        self.state[i], self.join_from[i] = JOINING, t
        self.known[i] = list(self.version)
        link = t + 4 * self.cfg.params * self.slow_l[i] / self.bw_l[i]
        done = max([link] + [s.send(t, b) for s, b in zip(self.shards, self.join_bytes)])
        self._at(done + self.lat_l[i], READY, i, self.gen[i])

    def _ready(self, t: float, i: int, gen: int) -> None:
        if gen != self.gen[i]:
            return
        self.out.rejoin_steps += (t - self.join_from[i]) / self.step_s[i]
        nf = self.cfg.fragments
        self.state[i] = TRAINING
        self.step[i], self.t_acc[i] = 0, t
        self.pos[i] = self.cyc[i] = self.sub[i] = 0
        self.last_push[i], self.carried[i] = [0] * nf, [0] * nf
        self.tick[i] += 1
        self._at(t + self.cycle[0][0] * self.step_s[i], DUE, i, self.tick[i])

    def _slow_on(self, t: float, i: int, _) -> None:
        self.slow[i] = self.slow_l[i] = self.trace.slow_factor

    def _slow_off(self, t: float, i: int, _) -> None:
        self.slow[i] = self.slow_l[i] = 1.0

    # ---- the shards' rounds ------------------------------------------------------------
    def _round(self, f: int) -> OpenRound:
        return OpenRound(f, MergeAccumulator(1, "mean"))  # no sum: the model holds no values

    def _arrive(self, t: float, pid: int, _) -> None:
        p = self.pushes[pid]
        i, f = p.island, p.fragment
        if pid not in self.wire[i]:
            return  # lost on the wire: its island crashed before the last byte
        self.wire[i].discard(pid)
        stale = self.version[f] - p.base
        if stale > self.cfg.max_staleness:
            self.out.refused += 1
            self.carried[i][f] += p.steps
            if self.inflight[i].pop(f, None) is not None:
                self.by_frag[f].discard(i)
            if self.waiting[i]:
                self._at(t, RETRY, i, self.tick[i])
            return
        self.out.stale_accepted += stale > 0
        rnd = self.open[f]
        first, quorate = rnd.first_push_at is None, rnd.quorum_at is not None
        self.pacing.pushed(rnd, i, max(1, p.steps), t)
        if first or (not quorate and rnd.quorum_at is not None):
            self._at_next_deadline(t, f)
        if len(rnd.learners) >= len(self.live):
            self._maybe_commit(t, f)

    def _at_next_deadline(self, t: float, f: int) -> None:
        due = [d for d, _ in self.pacing.deadlines(self.open[f], self.live)]
        if due:
            self._at(max(t, min(due)), CHECK, f, self.serial[f])

    def _check(self, t: float, f: int, serial: int) -> None:
        if serial == self.serial[f] and not self._maybe_commit(t, f):
            self._at_next_deadline(t, f)

    def _maybe_commit(self, t: float, f: int) -> bool:
        reason = self.pacing.reason(self.open[f], self.live, t)
        if reason is None:
            return False
        self._commit(t, f, reason)
        return True

    def _commit(self, t: float, f: int, reason: str) -> None:
        """Fragment f's round commits at t: a new version, broadcast to every live island."""
        self.version[f] += 1
        self.serial[f] += 1
        self.commit_times[f].append(t)
        self.out.commits[reason] += 1
        self.open[f] = self._round(f)
        idx = np.fromiter(self.live, dtype=np.int64, count=len(self.live))
        nbytes = self.down_bytes[f]
        done = self.shards[self.owner[f]].send(t, len(idx) * nbytes)
        d = np.full(self.fleet.islands, INF)
        d[idx] = np.maximum(done, t + nbytes * self.slow[idx] / self.bw[idx]) + self.lat[idx]
        deliveries = d.tolist()
        self.recent[f].append((self.version[f], deliveries))
        for i in list(self.by_frag[f]):
            entry = self.inflight[i][f]
            di = deliveries[i]
            if entry[0] < di < entry[1]:
                entry[1] = di
                if self.waiting[i]:
                    self._at(di, RETRY, i, self.tick[i])

    # ---- the end -----------------------------------------------------------------------
    def _finish(self) -> None:
        end, out = self.seconds, self.out
        for i in range(self.fleet.islands):
            if self.state[i] == TRAINING:
                if self.waiting[i]:
                    out.stalled_steps += (end - self.wait_from[i]) / self.step_s[i]
                else:
                    self._train_until(end, i)
            elif self.state[i] == JOINING:
                out.rejoin_steps += (end - self.join_from[i]) / self.step_s[i]
            out.down_steps += sum(min(b, end) - a for a, b in self.trace.crashes[i]
                                  if a < end) / self.step_s[i]
        gaps = [np.diff(ts).mean() for ts in self.commit_times if len(ts) > 1]
        out.round_s = float(np.mean(gaps)) if gaps else math.nan
        rate = self.cfg.cpu_s_per_byte
        out.shard_bytes_in = [s.bytes_in for s in self.shards]
        out.shard_bytes_out = [s.bytes_out for s in self.shards]
        out.shard_cpu_s = [(s.bytes_in + s.bytes_out) * rate for s in self.shards]
        out.shard_backlog_s = [s.backlog_s for s in self.shards]
