"""Chaos harness: a real fleet under a seeded schedule of faults, then the run's checks.

    python -m yeto.testing.chaos --faults 20 --seed 1     (from a checkout: scripts/chaos.py)

It starts a syncer (`python -m syncer`) and --islands numpy islands
(yeto.testing.synthetic: the real Island and gRPC client), all on 127.0.0.1, with a
run secret (islands get it in YETO_TOKEN and derive their own credentials), plus a rogue
client inside this process that holds its own valid credential
(`yeto.net.island_credential(secret, "rogue")`). Then it injects --faults faults drawn by
random.Random(--seed) from these kinds (every kind once first, in a shuffled order, then
at random; --kinds picks some):

  island-kill     kill -9 of an island; restarted, it rejoins under the same learner id
  syncer-kill     kill -9 of the syncer; restarted with --resume on the same state dir, port
  island-stop     SIGSTOP of an island until the fleet committed twice without it; SIGCONT
  silent-streams  the rogue opens Push streams that send a header and then nothing, and
                  streams that send nothing at all; the fleet must commit while some are
                  still open (a commit only once the syncer cut them all off: starved, fail)
  garbage         random bytes (and an HTTP/2 preface, and HTTP/1) straight onto the port
  direct-port     the syncer's direct downlink port: garbage, a hello of 1 GiB, a hello in
                  another island's name (must be refused PERMISSION_DENIED), then readers
                  with a valid hello that never read past their broadcast's header: the
                  fleet must commit twice while they stall
  rogue-values    the rogue, as itself, pushes a NaN, f32 values of 1e38, and q4 whose block
                  scales are 3e38: each must be refused
  impersonation   the rogue sends Join and Push as an island, with its own credential:
                  each must be refused (UNAUTHENTICATED or PERMISSION_DENIED)
  disk-full       (root: the state dir is on a small tmpfs) a filler file fills it until the
                  syncer notices (a log line or its exit); the filler goes, and a syncer
                  that exited is resumed
  link-cut        the last island dials the syncer through a TCP relay in this process
                  (127.0.0.1 too: no network namespaces needed); the relay drops its
                  connections and refuses new ones, or holds every byte, until the fleet
                  committed twice without it; then the link comes back
  rogue-claims    the rogue joins declaring the most tokens per step a join may
                  (--max-tokens-per-step) and a push every 100 steps, then pushes 100,000
                  steps, and tokens one over steps × its declaration: each refused
                  INVALID_ARGUMENT; then exactly the steps the refusal named as its bound,
                  with the most tokens they may hold: accepted. Its share of that merge
                  (the tape's) must be within the cap, 2/k for k islands in the merge (1 for
                  k <= 2); up to 3 such pushes, until one lands in a merge of k >= 3.
                  It starts after a commit with every island in it: the syncer decides
                  whether a round may be capped when the round opens, by the islands live
                  then (a round that opened with 2 has no cap, however many push to it)
  rogue-bound     the rogue pushes ±max_delta in one direction (far over the norm bound)
                  once a round for --bound-rounds rounds: each must be merged at <= its
                  bound, 10 × the lower median of the other islands' median norms (their
                  last 8, as the tape lists them) (the tape's norm × bound_scale); max |Θ|
                  before and after is said
  seed-race       a fresh run on a second syncer (--quorum 2): an honest raw client joins
                  first, the rogue second and sends a seed of 9.9e7 values before it: it
                  must be refused FAILED_PRECONDITION, and Θ must be the honest seed
  observer-first  a fresh run on a second syncer: an observer with another layout joins
                  first, then an island with the real one: accepted and asked for the seed;
                  the observer's next Heartbeat and its rejoin are refused
  seed-vote       a fresh run on a second syncer (--quorum 3): the rogue joins first,
                  declares its own initial weights and seeds them; two honest raw clients
                  join declaring others: the first quorum must unseed the rogue's Θ, ask
                  the first honest client (at its next join) and start from its seed

Every wait is on an event (a process exit, a tape or log line, an RPC answer) and has a
bound (--wait-s) that fails loudly; every fault ends with a committed round. After the
schedule the syncer is stopped cleanly (SIGTERM) and resumed with --rounds <saved version
+ --final-rounds> (not a fault: it ends the run a few rounds after the last one), and the
islands run until the final weights arrive. Then:

  lost_commits       the tape's merge versions are 1..R, each once; each resume continued
                     from the version saved when the syncer stopped; no version reached the
                     islands with two different Θ; the final state is version R
  theta_finite       Θ and the momentum in state.safetensors are finite at every snapshot
                     (after each fault and at the end: a non-finite Θ stays non-finite)
  islands_identical  every island's final weights == the syncer's final Θ == final/, bit
                     for bit

Then the drift (--drift-rounds, in this process: `syncer.run.Run` objects driven round by
round through the real Run.push, f32 pushes, the fleet's outer step; deterministic): the
fleet's synthetic islands (yeto.testing.synthetic.Quadratic, seeds 0.., H = --sync-every, its
tokens per step) from a LoRA-like Θ_0, and the rogue beside them with rogue-claims' most
claims, pushing in one direction every round, in two ways: ±max_delta (summed at its
norm bound), and the honest pushes' median plus 1, 2, 3 or 5 × what the centre bound
allows (pulled in to it; syncer.bounds, "The centre").
rogue_drift_ratio = ‖Θ_R − Θ_0‖ with a minority rogue (beside max(3, --islands) honest
islands; the largest of those rogues) ÷ the same honest islands alone;
rogue_drift_half beside one honest island;
rogue_drift_alone the rogue alone ÷ one honest island alone. A run in which an honest
push is refused (Θ pushed so far that its delta is over max_delta) stops there: its
ratio is a lower bound. Measured, not checked (the exit status does not depend on it).

One line per fault as it goes (kind, target, outcome), and the last line:
RESULT faults=N kinds=K rounds=R lost_commits=0 theta_finite=1 islands_identical=1
       rogue_share_max=S share_cap=C rogue_drift_ratio=D rogue_drift_half=D2
       rogue_drift_alone=D1
(one line) where S is the rogue's largest share of a merge of k >= 3 islands in
rogue-claims (of any merge if none had k >= 3) and C the cap in that merge; -1 for a
figure not measured. The exit status is 0 only when every check and every fault passed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import errno
import functools
import json
import logging
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import grpc
import numpy as np

from syncer import spawn, state
from syncer.bounds import HISTORY, Bounds
from syncer.errors import Reject
from syncer.merge import MERGE_RULES
from syncer.messages import PushHeader
from syncer.run import Config, Run
from syncer.staging import WholePush
from syncer.tape import Tape
from yeto import codec, net, wire
from yeto.client.sender import seed_sha256
from yeto.layout import Layout
from yeto.proto import yeto_pb2 as pb
from yeto.proto import yeto_pb2_grpc as pb_grpc
from yeto.testing.synthetic import Quadratic, layout_for
from yeto.testing.synthetic import build_parser as island_parser

ROOT = Path(__file__).resolve().parents[2]  # holds yeto and syncer: the processes' cwd
SIM = [sys.executable, "-m", "yeto.testing.synthetic"]
OPEN_ROUNDS = 1_000_000  # the run's --rounds until the schedule is over
RPC_S = 15.0             # deadline of each of the rogue's unary calls
RESUMED = re.compile(r"resumed run \S+ at version (\d+)")
DISK_FULL = re.compile(r"(?i)no space left|errno 28|enospc|disk (is )?full")
IDENTITY = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
OUTER, OUTER_LR, OUTER_MOMENTUM = "nesterov", 0.7, 0.9  # the fleet's outer step (and drift's)
BOUNDS = Bounds()  # the syncer's bounds: the harness passes none of their flags
ROGUE_TOKENS = BOUNDS.max_tokens_per_step  # the most tokens per step a join may declare
ROGUE_EVERY = 100  # the steps between pushes the rogue declares (rogue-claims, drift)
# the last line of a Python traceback in the syncer's log
EXCEPTION = re.compile(r"^((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit)\b:?.*)$",
                       re.MULTILINE)


class ChaosError(RuntimeError):
    """A wait that ran past its bound, or a process that died unasked."""


class FaultFailed(RuntimeError):
    """The fault ran and the fleet handled it wrongly (the message says how)."""


def say(line: str) -> None:
    print(line, flush=True)


# ---- the tape, read as it grows -------------------------------------------------------------
class TapeWatch:
    """The merge records of state-dir/tape.jsonl, read incrementally (only whole lines)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.rest = path, 0, b""
        self.merges: list[dict] = []
        self.resumed: list[int] = []  # the versions the syncer resumed at (its state's)
        self.torn = 0  # lines that are not JSON (a record cut by a kill, then appended to)

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        self.offset += len(data)
        *lines, self.rest = (self.rest + data).split(b"\n")
        for line in lines:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                self.torn += 1
                continue
            if rec.get("event") == "merge":
                self.merges.append(rec)
            elif rec.get("event") == "resumed":
                self.resumed.append(rec["version"])

    @property
    def version(self) -> int:
        return self.merges[-1]["version"] if self.merges else 0


def responders(merge: dict) -> set[str]:
    return {r["learner"] for r in merge.get("responders", ())}


def records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line cut by kill -9
    return out


# ---- a link that can be cut -------------------------------------------------------------------
class Relay:
    """A TCP relay on 127.0.0.1 between one island and the syncer (the island dials the
    relay's port), so its link can be cut without network namespaces: "drop" closes its
    connections and every new one at once (a link reset, a NAT that forgets), "hold"
    keeps them open but moves no byte (a silent link) until `mend`."""

    def __init__(self, upstream: Callable[[], int]):
        self.upstream = upstream  # the syncer's port now
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.mode = "open"
        self.cond = threading.Condition()
        self.socks: set[socket.socket] = set()
        self.closed = False
        threading.Thread(target=self._accept, daemon=True, name="relay").start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            if self.mode == "drop":
                down.close()
                continue
            try:
                up = socket.create_connection(("127.0.0.1", self.upstream()), timeout=RPC_S)
                up.settimeout(None)
            except OSError:
                down.close()  # the syncer is down: as if the connection were refused
                continue
            with self.cond:
                self.socks |= {down, up}
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                with self.cond:
                    self.cond.wait_for(lambda: self.mode != "hold" or self.closed)
                dst.sendall(data)
        except OSError:
            pass
        self._close(src, dst)

    def _close(self, *socks: socket.socket) -> None:
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
            with self.cond:
                self.socks.discard(s)

    def cut(self, mode: str) -> None:
        with self.cond:
            self.mode = mode
            socks = list(self.socks) if mode == "drop" else []
        self._close(*socks)

    def mend(self) -> None:
        with self.cond:
            self.mode = "open"
            self.cond.notify_all()

    def close(self) -> None:
        self.closed = True
        self.mend()
        self.listener.close()
        self._close(*list(self.socks))


# ---- the fleet --------------------------------------------------------------------------------
class Fleet:
    """The syncer and island processes, their files, and waits on their events."""

    def __init__(self, args, workdir: Path):
        self.args, self.workdir = args, workdir
        self.secret = secrets.token_hex(16)
        self.fs = workdir / "statefs"  # a tmpfs when root (see mount_tmpfs)
        self.state_dir = self.fs / "state"
        self.tape = TapeWatch(self.state_dir / "tape.jsonl")
        self.log_path = workdir / "syncer.log"
        self.log_file = None
        self.syncer: spawn.SyncerProcess | None = None
        self.port = 0
        self.ids = [f"island-{i}" for i in range(args.islands)]
        self.relayed = self.ids[-1]  # dials the syncer through `relay` (link-cut)
        self.relay: Relay | None = None
        self.islands: dict[str, subprocess.Popen] = {}
        self.stopped: set[str] = set()
        self.records = {lid: workdir / f"{lid}.jsonl" for lid in self.ids}
        self.resumes: list[dict] = []     # one per syncer restart with --resume
        self.snapshots: list[tuple] = []  # (label, version, finite, max |Θ|)
        self.tmpfs_problem: str | None = "not set up"
        self.mounted = False
        self.ending = False  # the final rounds: islands exit by themselves
        self.shares: list[tuple[int, float, int]] = []  # rogue-claims: (version, share, k)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def env(self) -> dict:
        return dict(os.environ, **{net.TOKEN_ENV: self.secret})

    # ---- processes ----------------------------------------------------------------------
    def start_syncer(self, resume: bool = False, rounds: int = OPEN_ROUNDS,
                     quorum: int | None = None) -> None:
        if self.log_file is not None:
            self.log_file.close()
        self.log_file = open(self.log_path, "a")  # noqa: SIM115 - closed by close()
        a = self.args
        flags = ["--state-dir", str(self.state_dir), "--quorum", str(quorum or a.quorum),
                 "--rounds", str(rounds), "--grace", "fixed", "--grace-ms", "100",
                 "--round-timeout-s", "10", "--outer", OUTER, "--outer-lr", str(OUTER_LR),
                 "--outer-momentum", str(OUTER_MOMENTUM)]
        try:
            self.syncer = spawn.start_syncer(flags + (["--resume"] if resume else []),
                                             port=self.port, cwd=ROOT, env=self.env(),
                                             log=self.log_file, timeout_s=a.wait_s)
        except spawn.SyncerStartError as e:
            self.syncer = None
            raise ChaosError(f"the syncer did not start: {e}") from None
        self.port = self.syncer.port

    def start_island(self, lid: str) -> None:
        a = self.args
        port = self.relay.port if lid == self.relayed and self.relay else self.port
        cmd = [*SIM, "--syncer", f"127.0.0.1:{port}", "--learner-id", lid,
               "--dim", str(a.dim), "--steps", str(10**9), "--sync-every", str(a.sync_every),
               "--step-seconds", str(a.step_seconds), "--seed", str(self.ids.index(lid)),
               "--record", str(self.records[lid])]
        with open(self.workdir / f"{lid}.log", "a") as log:
            self.islands[lid] = subprocess.Popen(cmd, cwd=ROOT, env=self.env(), stdout=log,
                                                 stderr=subprocess.STDOUT)

    def start(self) -> None:
        self.start_syncer()
        self.relay = Relay(lambda: self.port)
        for lid in self.ids:
            self.start_island(lid)
        self.next_merge("the first commit", bound=self.args.wait_s * 2)

    def signal_island(self, lid: str, sig: int) -> None:
        p = self.islands[lid]
        if p.poll() is None:
            p.send_signal(sig)
        if sig == signal.SIGSTOP:
            self.stopped.add(lid)
        elif sig == signal.SIGCONT:
            self.stopped.discard(lid)

    def heal(self) -> list[str]:
        """Bring the fleet back after a failed fault: SIGCONT, restart what is dead."""
        done = []
        if self.relay is not None and self.relay.mode != "open":
            self.relay.mend()
            done.append("link mended")
        for lid in sorted(self.stopped):
            self.signal_island(lid, signal.SIGCONT)
            done.append(f"SIGCONT {lid}")
        if self.syncer is None or self.syncer.poll() is not None:
            rec = self.resume_syncer("heal")
            done.append(f"syncer resumed at v{rec['resumed']}")
        for lid in self.ids:
            p = self.islands.get(lid)
            if p is None or p.poll() is not None:
                self.start_island(lid)
                done.append(f"restarted {lid}")
        return done

    def resume_syncer(self, why: str, final_rounds: int | None = None) -> dict:
        """Restart a stopped syncer with --resume (same state dir and port); the record
        (tape and saved versions at the stop, the version it resumed at) goes into the
        final checks. With `final_rounds` the run ends that many rounds on, and rounds wait
        for every island (quorum = all): none misses the final weights while it is still
        in its reconnect backoff."""
        self.tape.poll()
        try:
            meta = state.load(self.state_dir)[3]
        except (state.StateError, OSError) as e:
            raise FaultFailed(f"the saved state is unreadable after the syncer stopped: {e}") \
                from None
        saved = int(meta["version"])
        rec = dict(why=why, tape=self.tape.version, saved=saved, index=len(self.tape.merges))
        mark = self.log_size()
        if final_rounds is None:
            self.start_syncer(resume=True)
        else:
            self.start_syncer(resume=True, rounds=saved + final_rounds, quorum=len(self.ids))
        found = self.wait_for("'resumed run' in the syncer's log",
                              lambda: RESUMED.search(self.log_since(mark)))
        rec["resumed"] = int(found.group(1))
        self.resumes.append(rec)
        if rec["resumed"] != saved:
            raise FaultFailed(f"the syncer resumed at v{rec['resumed']}, the state saved "
                              f"v{saved}")
        return rec

    # ---- events -------------------------------------------------------------------------
    def log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def log_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def check(self, syncer_may_exit: bool = False) -> None:
        """Read the tape; raise ChaosError if a process died unasked."""
        self.tape.poll()
        if self.ending:
            return
        for lid, p in self.islands.items():
            if p.poll() is not None:
                tail = (self.workdir / f"{lid}.log").read_text(errors="replace")[-1500:]
                raise ChaosError(f"{lid} exited by itself (code {p.returncode}); its log "
                                 f"ends:\n{tail}")
        s = self.syncer
        if s is not None and not syncer_may_exit and s.poll() is not None:
            raise ChaosError(f"the syncer exited by itself (code {s.returncode}); its log "
                             f"ends:\n{s.tail(15)}")

    def wait_for(self, what: str, pred: Callable, bound: float | None = None,
                 syncer_may_exit: bool = False):
        """Poll `pred` (and the processes) until it returns something true; ChaosError
        after `bound` seconds (default --wait-s)."""
        bound = bound or self.args.wait_s
        deadline = time.monotonic() + bound
        while True:
            self.check(syncer_may_exit)
            got = pred()
            if got:
                return got
            if time.monotonic() > deadline:
                raise ChaosError(f"no {what} within {bound:.0f} s (tape at "
                                 f"v{self.tape.version})")
            time.sleep(0.05)

    def next_merge(self, what: str, who: str | set[str] | None = None,
                   without: str | None = None, after: int | None = None,
                   bound: float | None = None) -> dict:
        """Wait for a merge record past tape index `after` (default: now) that has `who`
        (an island, or each of a set) among its responders and not `without`."""
        self.tape.poll()
        start = len(self.tape.merges) if after is None else after
        wanted = {who} if isinstance(who, str) else set(who or ())

        def found():
            for m in self.tape.merges[start:]:
                ids = responders(m)
                if wanted <= ids and (without is None or without not in ids):
                    return m
            return None
        return self.wait_for(what, found, bound)

    def snapshot(self, label: str) -> tuple | None:
        """Θ and momentum as saved now: (label, version, finite, max |Θ|)."""
        try:
            theta, momentum, _, meta = state.load(self.state_dir)
        except (state.StateError, OSError) as e:
            say(f"         note: no state snapshot {label}: {e}")
            return None
        finite = bool(np.isfinite(theta).all()) and (
            momentum is None or bool(np.isfinite(momentum).all()))
        snap = (label, int(meta["version"]), finite,
                float(np.nanmax(np.abs(theta))) if theta.size else 0.0)
        self.snapshots.append(snap)
        return snap

    # ---- the state dir's file system -------------------------------------------------
    def mount_tmpfs(self) -> None:
        self.fs.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            self.tmpfs_problem = "not root (the state dir needs its own small tmpfs)"
            return
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.args.tmpfs_mib}m,"
                            "mode=0700", "tmpfs", str(self.fs)], capture_output=True, text=True)
        if r.returncode != 0:
            self.tmpfs_problem = f"mount -t tmpfs failed: {r.stderr.strip() or r.returncode}"
            return
        self.mounted, self.tmpfs_problem = True, None

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()
        procs = [*self.islands.values()] + ([self.syncer.proc] if self.syncer else [])
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)  # works on stopped processes too
                p.wait()
        if self.syncer is not None:
            self.syncer.close()
        if self.log_file is not None:
            self.log_file.close()
        if self.mounted:
            r = subprocess.run(["umount", str(self.fs)], capture_output=True)
            if r.returncode != 0:
                subprocess.run(["umount", "-l", str(self.fs)], capture_output=True)
            self.mounted = False


# ---- the rogue: a client in this process with its own valid credential ---------------------
class Rogue:
    """Raw stubs (yeto/proto) on a fresh channel, with the credential of its own learner
    id: "rogue", or another id for an honest raw client (seed-race, observer-first);
    `address` (default: the fleet's syncer) and `layout` (default: the fleet's)."""

    def __init__(self, fleet: Fleet, address: str | None = None, learner_id: str = "rogue",
                 layout: Layout | None = None):
        self.fleet, self.lid = fleet, learner_id
        self.layout = layout or layout_for(fleet.args.dim)
        self.cred = net.island_credential(fleet.secret, learner_id)
        self.md = net.auth_metadata(self.cred)
        self.channel = grpc.insecure_channel(address or fleet.address, options=net.GRPC_OPTIONS)
        self.stub = pb_grpc.SyncerStub(self.channel)
        self.gen, self.seq = 0, 0

    def join(self, learner_id: str | None = None, **declared) -> pb.JoinReply:
        """Join as `learner_id` (default: its own) with `declared` JoinRequest fields
        (tokens_per_step, sync_every, observer)."""
        lid = learner_id or self.lid
        specs = [pb.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype)
                 for s in self.layout.specs]
        reply = self.stub.Join(pb.JoinRequest(
            learner_id=lid, layout=specs, fingerprint=self.layout.fingerprint,
            backend="numpy", weights_file="weights.safetensors", **declared),
            metadata=self.md, timeout=RPC_S)
        if lid == self.lid:
            self.gen, self.seq = reply.generation, max(self.seq, reply.last_seq + 1)
        return reply

    def join_as_self(self, **declared) -> pb.JoinReply:
        """Join as itself; FaultFailed when the syncer refuses its valid credential
        (then no rogue fault can test what it means to)."""
        try:
            return self.join(**declared)
        except grpc.RpcError as e:
            raise FaultFailed(f"the syncer refused {self.lid}'s own valid credential at Join "
                              f"({e.code().name}: {e.details()}): per-island credentials "
                              "(yeto.net.island_credential) not accepted, fault not "
                              "exercised") from None

    def version(self) -> int:
        return self.stub.Heartbeat(pb.HeartbeatRequest(learner_id=self.lid, generation=self.gen),
                                   metadata=self.md, timeout=RPC_S).version

    def header(self, encoding: str, version: int, learner_id: str | None = None,
               generation: int | None = None, seq: int | None = None,
               **fields) -> pb.PushHeader:
        """A push header against `version`; `fields` replace its claims (loss_tokens,
        steps) or its kind (pb.SEED)."""
        n = self.layout.numel
        return pb.PushHeader(**dict(dict(
            learner_id=learner_id or self.lid,
            generation=self.gen if generation is None else generation,
            round=version + 1, base_version=version, loss_tokens=5 * 100, steps=5,
            encoding=encoding, numel=n, payload_bytes=codec.encoded_size(encoding, n),
            kind=pb.DELTA, seq=self.seq if seq is None else seq, train_loss=float("nan"),
            eval_loss=float("nan")), **fields))

    def push(self, header: pb.PushHeader, payload: bytes) -> pb.PushReply:
        chunks = [pb.PushChunk(header=header if i == 0 else None, data=bytes(piece))
                  for i, piece in enumerate(net.chunks(payload))]
        return self.stub.Push(iter(chunks), metadata=self.md, timeout=RPC_S)

    def push_now(self, encoding: str, payload: bytes, **claims) -> pb.PushReply:
        """Push against the current version; again if rounds committed meanwhile and it
        came too stale (so a refusal is for the payload or `claims`, not for being late)."""
        for _ in range(5):
            try:
                reply = self.push(self.header(encoding, self.version(), **claims), payload)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION and "stale" in e.details():
                    continue
                raise
            self.seq += reply.accepted
            return reply
        raise ChaosError(f"{self.lid}'s push came stale five times running")

    def finish(self) -> None:
        try:
            self.stub.Finish(pb.FinishRequest(learner_id=self.lid, generation=self.gen),
                             metadata=self.md, timeout=RPC_S)
        except grpc.RpcError:
            pass  # it never joined, or the syncer is gone: nothing to leave

    def island_generation(self, learner_id: str) -> int:
        """`learner_id`'s current generation from the Status RPC (rogue's credential, then
        the run's secret, as an operator would); 0 when neither may ask."""
        for token in (self.cred, self.fleet.secret):
            try:
                reply = self.stub.Status(pb.StatusRequest(), metadata=net.auth_metadata(token),
                                         timeout=RPC_S)
            except grpc.RpcError:
                continue
            return next((i.generation for i in reply.islands if i.learner_id == learner_id), 0)
        return 0

    def close(self) -> None:
        self.channel.close()


# ---- the faults -----------------------------------------------------------------------------
def inject_island_kill(fleet: Fleet, rng: random.Random) -> tuple[str, str]:
    lid = rng.choice(fleet.ids)
    p = fleet.islands.pop(lid)
    p.send_signal(signal.SIGKILL)
    code = p.wait(timeout=fleet.args.wait_s)
    fleet.stopped.discard(lid)
    without = fleet.next_merge(f"commit without {lid}", without=lid)
    mark = len(fleet.tape.merges)
    fleet.start_island(lid)
    back = fleet.next_merge(f"commit with the restarted {lid}", who=lid, after=mark)
    return lid, (f"exit {code}; fleet committed v{without['version']} without it; "
                 f"restarted, it pushed into v{back['version']}")


def inject_syncer_kill(fleet: Fleet, rng: random.Random) -> tuple[str, str]:
    fleet.syncer.kill()
    code = fleet.syncer.returncode
    rec = fleet.resume_syncer("syncer-kill")
    m = fleet.next_merge("commit after the resume", after=rec["index"])
    if m["version"] != rec["saved"] + 1:
        raise FaultFailed(f"saved v{rec['saved']}, but the first commit after the resume is "
                          f"v{m['version']}")
    return "syncer", (f"exit {code} at tape v{rec['tape']}, saved v{rec['saved']}; resumed "
                      f"at v{rec['resumed']}, next commit v{m['version']}")


def away_and_back(fleet: Fleet, lid: str, what: str, mend) -> tuple[dict, dict, dict]:
    """Two commits without `lid` while `what` holds, then `mend()`, then a commit with
    `lid` in it: (first, second, back) merge records."""
    try:
        first = fleet.next_merge(f"commit while {what}", without=lid)
        idx = fleet.tape.merges.index(first) + 1
        second = fleet.next_merge(f"second commit while {what}", without=lid, after=idx)
    finally:
        mend()
    mark = len(fleet.tape.merges)
    back = fleet.next_merge(f"commit with {lid} after {what}", who=lid, after=mark)
    return first, second, back


def inject_island_stop(fleet: Fleet, rng: random.Random) -> tuple[str, str]:
    lid = rng.choice(fleet.ids)
    fleet.signal_island(lid, signal.SIGSTOP)
    first, second, back = away_and_back(fleet, lid, f"{lid} is stopped",
                                        lambda: fleet.signal_island(lid, signal.SIGCONT))
    return lid, (f"stopped through v{first['version']}..v{second['version']}; after SIGCONT "
                 f"it pushed into v{back['version']}")


def _silent(header: pb.PushHeader | None, release: threading.Event, bound: float):
    """A Push stream that sends `header` (if any) and then nothing until released."""
    if header is not None:
        yield pb.PushChunk(header=header)
    release.wait(bound)


def _open_silent(rogue: Rogue, fleet: Fleet, release: threading.Event,
                 ended: dict[int, tuple[float, str]]) -> list:
    """Open the silent streams: --silent-streams that send a header, 2 that send nothing.
    `ended[i]`: when stream i ended and its status."""
    header = rogue.header("f32", rogue.version())
    calls = []
    for i in range(fleet.args.silent_streams + 2):
        gen = _silent(header if i < fleet.args.silent_streams else None, release,
                      fleet.args.wait_s * 2)
        call = rogue.stub.Push.future(gen, metadata=rogue.md, timeout=fleet.args.wait_s * 2)
        call.add_done_callback(
            lambda c, i=i: ended.setdefault(i, (time.monotonic(), c.code().name)))
        calls.append(call)
    return calls


def inject_silent_streams(fleet: Fleet, rng: random.Random) -> tuple[str, str]:
    """The fleet must commit while some of the rogue's silent streams are still open:
    streams that hold the syncer's push slots until an idle cutoff starve the honest
    islands until then (and a rogue may open them again at once)."""
    rogue = Rogue(fleet)
    release, calls, ended, m, stalled = threading.Event(), [], {}, None, None
    try:
        rogue.join_as_self()
        t0 = time.monotonic()
        calls = _open_silent(rogue, fleet, release, ended)
        try:
            m = fleet.next_merge(f"commit while {len(calls)} silent Push streams are open")
        except ChaosError as e:
            stalled = str(e)
        seen = dict(ended)  # before the harness cancels the rest
    finally:
        for c in calls:
            c.cancel()  # the harness's own bound on them
        release.set()
        rogue.finish()
        rogue.close()
    what = f"{len(calls)} silent streams ({fleet.args.silent_streams} header-only)"
    codes = collections.Counter(code for _, code in seen.values())
    ends = ", ".join(f"{n} {code}" for code, n in sorted(codes.items())) or "none"
    if stalled:
        after = fleet.next_merge("commit after the harness cancelled the silent streams")
        raise FaultFailed(f"{what}: the fleet stalled ({stalled}); the syncer ended {ends}; "
                          f"once the harness cancelled the rest it committed v{after['version']}")
    if len(seen) == len(calls):
        last = max(t for t, _ in seen.values()) - t0
        raise FaultFailed(f"{what}: the fleet committed v{m['version']} only after the syncer "
                          f"had ended all of them ({ends}; the last after {last:.1f} s): "
                          "starved until then")
    return "rogue", (f"{what}: fleet committed v{m['version']} with {len(calls) - len(seen)} "
                     f"still open; the syncer had ended {ends}")


def _drain(sock: socket.socket, bound: float) -> str:
    """Read until the peer closes (what a server does with garbage), at most `bound` s."""
    sock.settimeout(bound)
    got = 0
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return f"closed by the syncer ({got} B back)"
            got += len(data)
    except TimeoutError:
        return f"still open after {bound:.0f} s ({got} B back), closed by us"
    except OSError as e:
        return f"reset by the syncer ({e.__class__.__name__})"


def inject_garbage(fleet: Fleet, rng: random.Random) -> tuple[str, str]:
    blobs = {"random": rng.randbytes(4096),
             "h2-preface+junk": HTTP2_PREFACE + rng.randbytes(1024),
             "http/1": b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"}
    outcomes = []
    for name, blob in blobs.items():
        with socket.create_connection(("127.0.0.1", fleet.port), timeout=RPC_S) as s:
            try:
                s.sendall(blob)
            except OSError as e:
                outcomes.append(f"{name}: send failed ({e.__class__.__name__})")
                continue
            outcomes.append(f"{name}: {_drain(s, 10.0)}")
    m = fleet.next_merge("commit after the garbage bytes")
    return f"port {fleet.port}", "; ".join(outcomes) + f"; fleet committed v{m['version']}"


def inject_direct_port(fleet: Fleet, rng: random.Random) -> tuple[str, str]:
    """The syncer's direct downlink port (`syncer.direct`) under a rogue with a valid
    credential: garbage, a hello of impossible length, a hello in another island's
    name, then readers that say a valid hello and never read past their broadcast's
    header. The fleet must commit twice while those readers are open (a commit waits
    for no reader), and the impersonating hello must be refused."""
    rogue = Rogue(fleet, learner_id="rogue-reader")  # (an observer: its own id)
    stalled: list[socket.socket] = []
    try:
        reply = rogue.join_as_self(observer=True)
        if not reply.direct_port:
            raise FaultFailed("the syncer offers no direct port (started with --no-direct "
                              "or TLS): nothing to test")
        port, outcomes = reply.direct_port, []

        def hello(learner: str) -> bytes:
            return wire.direct_hello(pb.DirectHello(
                learner_id=learner, generation=rogue.gen, run_id=reply.run_id,
                authorization=f"Bearer {rogue.cred}"))

        blobs = {"random": rng.randbytes(4096),
                 "http/1": b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
                 "1 GiB hello": wire.DIRECT_MAGIC + (1 << 30).to_bytes(4, "little")}
        for name, blob in blobs.items():
            with socket.create_connection(("127.0.0.1", port), timeout=RPC_S) as s:
                s.sendall(blob)
                outcomes.append(f"{name}: {_drain(s, 15.0)}")
        with socket.create_connection(("127.0.0.1", port), timeout=RPC_S) as s:
            s.sendall(hello("island-0"))
            frame = wire.read_frame(s)
        refused = frame is not None and frame[0] == wire.FRAME_ERROR and \
            pb.DirectError.FromString(frame[1]).code == "PERMISSION_DENIED"
        if not refused:
            raise FaultFailed(f"a direct hello in island-0's name with the rogue's credential "
                              f"was not refused as PERMISSION_DENIED: {frame!r:.200}")
        for _ in range(3):
            s = socket.create_connection(("127.0.0.1", port), timeout=RPC_S)
            stalled.append(s)
            s.sendall(hello(rogue.lid))
            frame = wire.read_frame(s)
            if frame is None or frame[0] != wire.FRAME_HEADER:
                break  # (over the per-island stream bound: refused, as it should be)
        first = fleet.next_merge(f"commit while {len(stalled)} direct readers stall")
        second = fleet.next_merge(f"a second commit while {len(stalled)} direct readers stall")
    finally:
        for s in stalled:
            s.close()
        rogue.close()
    return (f"direct port {port}", "; ".join(outcomes) + "; impersonating hello refused; "
            f"fleet committed v{first['version']} and v{second['version']} beside "
            f"{len(stalled)} stalled direct readers")


def rogue_payloads(numel: int) -> dict[str, tuple[str, bytes]]:
    nan = np.full(numel, 0.01, np.float32)
    nan[numel // 2] = np.nan
    nb = -(-numel // codec.Q4_BLOCK)
    q4 = np.full(nb, 3e38, np.float32).tobytes() + bytes([0xFF]) * (nb * codec.Q4_BLOCK // 2)
    return {"NaN f32": ("f32", nan.tobytes()),
            "1e38 f32": ("f32", np.full(numel, 1e38, np.float32).tobytes()),
            "q4 scales 3e38": ("q4", q4)}


def inject_rogue_values(fleet: Fleet, rng: random.Random) -> tuple[str, str]:
    rogue = Rogue(fleet)
    got, bad = [], []
    try:
        rogue.join_as_self()
        for name, (encoding, payload) in rogue_payloads(rogue.layout.numel).items():
            try:
                reply = rogue.push_now(encoding, payload)
                bad.append(f"{name} ACCEPTED ({reply.status})")
            except grpc.RpcError as e:
                got.append(f"{name}: {e.code().name}")
                if e.code() in IDENTITY:
                    bad.append(f"{name} refused as {e.code().name}: for the credential, "
                               "not for the values")
    finally:
        rogue.finish()
        rogue.close()
    m = fleet.next_merge("commit after the rogue's pushes")
    snap = fleet.snapshot("after rogue-values")
    if snap is not None and not snap[2]:
        bad.append(f"Θ non-finite at v{snap[1]}")
    tail = f"; fleet committed v{m['version']}" + (
        f", max |Θ| {snap[3]:.3g}" if snap else "")
    if bad:
        raise FaultFailed("; ".join(bad + got) + tail)
    return "rogue", "; ".join(got) + tail


def _impersonate(rogue: Rogue, victim: str, fleet: Fleet) -> tuple[list[str], list[str]]:
    """Join, then Push, as `victim` with rogue's credential: (outcomes, failures)."""
    got, bad = [], []
    try:
        rogue.join(victim)
        bad.append(f"Join as {victim} ACCEPTED: its own connection was superseded")
    except grpc.RpcError as e:
        got.append(f"Join {e.code().name}")
        if e.code() not in IDENTITY:
            bad.append(f"Join refused with {e.code().name}, not for identity: {e.details()}")
    gen = rogue.island_generation(victim)
    header = rogue.header("f32", fleet.tape.version, learner_id=victim, generation=gen,
                          seq=1 << 40)
    try:
        reply = rogue.push(header, bytes(4 * rogue.layout.numel))
        bad.append(f"Push as {victim} ACCEPTED ({reply.status})")
    except grpc.RpcError as e:
        got.append(f"Push {e.code().name}" + ("" if gen else " (generation unknown)"))
        if e.code() not in IDENTITY:
            bad.append(f"Push refused with {e.code().name}, not for identity: {e.details()}")
    return got, bad


def inject_impersonation(fleet: Fleet, rng: random.Random) -> tuple[str, str]:
    victim = rng.choice(fleet.ids)
    rogue = Rogue(fleet)
    try:
        got, bad = _impersonate(rogue, victim, fleet)
    finally:
        rogue.close()
    mark = len(fleet.tape.merges)
    m = fleet.next_merge(f"commit with {victim} still pushing", who=victim, after=mark)
    text = "; ".join(got) + f"; {victim} pushed into v{m['version']}"
    if bad:
        raise FaultFailed("; ".join(bad) + f" [{text}]")
    return victim, text


def inject_link_cut(fleet: Fleet, rng: random.Random) -> tuple[str, str]:
    lid, mode = fleet.relayed, rng.choice(("drop", "hold"))
    fleet.relay.cut(mode)
    first, second, back = away_and_back(fleet, lid, f"{lid}'s link is cut ({mode})",
                                        fleet.relay.mend)
    return lid, (f"link {mode} through v{first['version']}..v{second['version']}; mended, it "
                 f"pushed into v{back['version']}")


def _fill(path: Path) -> int:
    """Write `path` until the file system is full; its size."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    total = 0
    try:
        for size in (1 << 20, 4096, 1):
            block = bytes(size)
            while True:
                try:
                    total += os.write(fd, block)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    return total


def inject_disk_full(fleet: Fleet, rng: random.Random) -> tuple[str, str]:
    filler = fleet.fs / "filler"
    mark = fleet.log_size()

    def noticed():
        if fleet.syncer.poll() is not None:
            return f"exit {fleet.syncer.returncode}"
        hit = DISK_FULL.search(fleet.log_since(mark))
        if hit:
            text = fleet.log_since(mark)
            line = text[text.rfind("\n", 0, hit.start()) + 1:].split("\n", 1)[0]
            return f"log: {line.strip()[:140]!r}"
        return None
    try:
        size = _fill(filler)
        how = fleet.wait_for("sign that the syncer noticed the full disk (log line or exit)",
                             noticed, syncer_may_exit=True)
    finally:
        filler.unlink(missing_ok=True)
    if fleet.syncer.poll() is not None:
        rec = fleet.resume_syncer("disk-full")
        how += f"; resumed at v{rec['resumed']}"
    m = fleet.next_merge("commit after the filler was removed")
    return "state dir", f"filled with {size >> 10} KiB; noticed: {how}; committed v{m['version']}"


# ---- the rogue's claims and norms -----------------------------------------------------------
CARRY = re.compile(r"can carry at most (\d+)")
CLAIM_TRIES = 3  # rogue-claims: pushes at the bound until one lands in a merge of k >= 3


def rogue_share(merge: dict, lid: str = "rogue") -> tuple[float, int]:
    """`lid`'s share of a merge as the tape gives it (the weights really merged), and k:
    how many islands pushed to it."""
    share = sum(r.get("share", 0.0) for r in merge.get("responders", ()) if r["learner"] == lid)
    return share, len(responders(merge))


def small_delta(numel: int, rng: random.Random) -> bytes:
    """A push an honest island could send (the claims are what is rogue about it)."""
    noise = np.random.default_rng(rng.getrandbits(32)).standard_normal(numel)
    return (0.01 * noise).astype(np.float32).tobytes()


def rogue_direction(numel: int, seed: int) -> np.ndarray:
    """±1 per value: the one direction the rogue pushes in all run long."""
    return np.where(np.random.default_rng(seed).standard_normal(numel) < 0, -1.0, 1.0) \
        .astype(np.float32)


def refused(rogue: Rogue, what: str, payload: bytes, code: grpc.StatusCode, **claims) -> str:
    """Push `payload` with `claims` now; its refusal's details (FaultFailed unless it was
    refused with `code`)."""
    try:
        reply = rogue.push_now("f32", payload, **claims)
    except grpc.RpcError as e:
        if e.code() != code:
            raise FaultFailed(f"{what}: refused with {e.code().name}, not {code.name} "
                              f"({e.details()})") from None
        return e.details()
    raise FaultFailed(f"{what}: ACCEPTED ({reply.status})")


def claims_refused(rogue: Rogue, payload: bytes) -> int:
    """Steps far beyond the declared schedule, then loss tokens one over steps × the
    declared tokens per step: both refused. Returns the bound the first refusal states."""
    steps = BOUNDS.max_steps_per_push
    details = refused(rogue, f"{steps} steps (declared every {ROGUE_EVERY})", payload,
                      grpc.StatusCode.INVALID_ARGUMENT, steps=steps,
                      loss_tokens=steps * ROGUE_TOKENS)
    found = CARRY.search(details)
    if not found:
        raise FaultFailed(f"{steps} steps refused, but not for the schedule: {details}")
    bound = int(found.group(1))
    refused(rogue, f"{bound} steps with {bound * ROGUE_TOKENS + 1} loss tokens", payload,
            grpc.StatusCode.INVALID_ARGUMENT, steps=bound, loss_tokens=bound * ROGUE_TOKENS + 1)
    return bound


def pushed_at_bound(fleet: Fleet, rogue: Rogue, payload: bytes, steps: int) -> dict:
    """Push `steps` steps (the bound) with the most loss tokens they may hold: accepted;
    the merge it went into."""
    fleet.tape.poll()
    mark = len(fleet.tape.merges)
    reply = rogue.push_now("f32", payload, steps=steps, loss_tokens=steps * ROGUE_TOKENS)
    if not reply.accepted:
        raise FaultFailed(f"{steps} steps at the bound: not merged ({reply.status})")
    return fleet.next_merge("commit with the rogue's push at its bound", who="rogue", after=mark)


def inject_rogue_claims(fleet: Fleet, rng: random.Random) -> tuple[str, str]:
    rogue, got, over = Rogue(fleet), [], []
    payload = small_delta(rogue.layout.numel, rng)
    # the rounds after a commit with every island open with all of them live: the syncer
    # decides whether a round's shares may be capped when it opens, by the islands live then
    fleet.next_merge("commit with every island in it", who=set(fleet.ids))
    try:
        rogue.join_as_self(tokens_per_step=ROGUE_TOKENS, sync_every=ROGUE_EVERY)
        for _ in range(CLAIM_TRIES):
            bound = claims_refused(rogue, payload)
            m = pushed_at_bound(fleet, rogue, payload, bound)
            share, k = rogue_share(m)
            fleet.shares.append((m["version"], share, k))
            cap = BOUNDS.share_cap(k)
            got.append(f"v{m['version']} {bound} steps: share {share:.3f}, k={k}, cap {cap:.3f}")
            if share > cap * (1 + 1e-6):
                over.append(f"v{m['version']}: share {share:.4f} > cap {cap:.4f} (k={k})")
            if k >= 3:
                break
    finally:
        rogue.finish()
        rogue.close()
    text = (f"declared {ROGUE_TOKENS} tokens/step, every {ROGUE_EVERY} steps; "
            f"{BOUNDS.max_steps_per_push} steps and tokens over the declaration: "
            "INVALID_ARGUMENT; at the bound: " + "; ".join(got))
    if over:
        raise FaultFailed("; ".join(over) + f" [{text}]")
    return "rogue", text


def bound_at(merges: list[dict], upto: int, lid: str = "rogue") -> float:
    """The norm bound `lid`'s push in merge `upto` (a tape index) met, as
    syncer.bounds.NormBounds sets it: norm_factor × the lower median of the other islands'
    medians of their last HISTORY norms before it (the tape lists pushes as they came)."""
    norms = collections.defaultdict(lambda: collections.deque(maxlen=HISTORY))
    for i, m in enumerate(merges[:upto + 1]):
        for r in m["responders"]:
            if i == upto and r["learner"] == lid:
                typical = sorted(float(np.median(h)) for who, h in norms.items() if who != lid)
                return BOUNDS.norm_factor * typical[(len(typical) - 1) // 2] if typical \
                    else float("inf")
            norms[r["learner"]].append(r["norm"])
    return float("inf")


def inject_rogue_bound(fleet: Fleet, rng: random.Random) -> tuple[str, str]:
    """The rogue pushes ±max_delta in one direction (far over the norm bound), one push
    a round for --bound-rounds rounds: each merged at ≤ norm_factor × the others' norms."""
    rogue = Rogue(fleet)
    payload = (rogue_direction(rogue.layout.numel, fleet.args.seed) * BOUNDS.max_delta) \
        .tobytes()
    before, merges = fleet.snapshot("before rogue-bound"), []
    try:
        rogue.join_as_self()
        for _ in range(fleet.args.bound_rounds):
            fleet.tape.poll()
            mark = len(fleet.tape.merges)
            reply = rogue.push_now("f32", payload)
            if not reply.accepted:
                raise FaultFailed(f"a push over the norm bound was not merged ({reply.status})")
            merges.append(fleet.next_merge("commit with the rogue's push", who="rogue",
                                           after=mark))
    finally:
        rogue.finish()
        rogue.close()
    if not merges:
        return "rogue", "no pushes (--bound-rounds 0)"
    mine = [next(r for r in m["responders"] if r["learner"] == "rogue") for m in merges]
    ratios = [r["norm"] * r["bound_scale"] / bound_at(fleet.tape.merges,
                                                      fleet.tape.merges.index(m))
              for r, m in zip(mine, merges)]
    after = fleet.snapshot("after rogue-bound")
    text = (f"{len(merges)} pushes of norm {mine[0]['norm']:.4g} in one direction, scaled by "
            f"{min(r['bound_scale'] for r in mine):.3g}..{max(r['bound_scale'] for r in mine):.3g}"
            f": merged at {min(ratios):.4f}..{max(ratios):.4f} × its bound ("
            f"{BOUNDS.norm_factor:g} × the others' typical norm, from the tape), share ≤ "
            f"{max(rogue_share(m)[0] for m in merges):.3f}"
            f"; max |Θ| {before[3] if before else float('nan'):.4g} → "
            f"{after[3] if after else float('nan'):.4g} (v{merges[-1]['version']})")
    if max(ratios) > 1 + 1e-4:
        raise FaultFailed(f"merged over the norm bound: {text}")
    return "rogue", text


# ---- races on a fresh run: a throwaway syncer --------------------------------------------
@contextlib.contextmanager
def throwaway_syncer(fleet: Fleet, name: str, quorum: int):
    """A second syncer (`python -m syncer`, the fleet's secret) for a fresh run: yields
    (its process, its state dir); stopped on leaving."""
    base = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=fleet.workdir))
    try:
        proc = spawn.start_syncer(["--state-dir", str(base / "state"), "--quorum", str(quorum),
                                   "--grace", "fixed", "--grace-ms", "100"], cwd=ROOT,
                                  env=fleet.env(), log=base / "syncer.log",
                                  timeout_s=fleet.args.wait_s)
    except spawn.SyncerStartError as e:
        raise ChaosError(f"the throwaway syncer did not start: {e}") from None
    try:
        yield proc, base / "state"
    finally:
        proc.stop()


def answered(what: str, call: Callable):
    """`call()`'s answer; FaultFailed when it was refused."""
    try:
        return call()
    except grpc.RpcError as e:
        raise FaultFailed(f"{what} was refused: {e.code().name}: {e.details()}") from None


def seed_race(fleet: Fleet, honest: Rogue, rogue: Rogue, state_dir: Path,
              rng: random.Random) -> str:
    first = answered("the honest client's Join", honest.join)
    second = answered("the rogue's Join", rogue.join)
    if not first.send_seed or second.send_seed:
        raise FaultFailed(f"send_seed: {first.send_seed} to the first to join (honest), "
                          f"{second.send_seed} to the second (rogue)")
    n = honest.layout.numel
    got = refused(rogue, "the rogue's seed of 9.9e7 values", np.full(n, 9.9e7, np.float32)
                  .tobytes(), grpc.StatusCode.FAILED_PRECONDITION, kind=pb.SEED)
    theta0 = np.frombuffer(small_delta(n, rng), np.float32)
    reply = answered("the honest seed", lambda: honest.push(
        honest.header("f32", 0, kind=pb.SEED), theta0.tobytes()))
    if not reply.accepted:
        raise FaultFailed(f"the honest seed was not taken ({reply.status})")
    seeded = fleet.wait_for("'seeded' on the throwaway syncer's tape", lambda: next(
        (r for r in records(state_dir / "tape.jsonl") if r.get("event") == "seeded"), None))
    if seeded["learner"] != honest.lid or seeded["theta_sha256"] != state.digest(theta0):
        raise FaultFailed(f"Θ was seeded by {seeded['learner']} (sha "
                          f"{seeded['theta_sha256'][:12]}), not by the honest seed")
    return (f"the rogue (second to join) seeded first: FAILED_PRECONDITION "
            f"({got.split(':')[0]}); "
            f"Θ = the honest seed (sha {seeded['theta_sha256'][:12]})")


def inject_seed_race(fleet: Fleet, rng: random.Random) -> tuple[str, str]:
    with throwaway_syncer(fleet, "seed-race", quorum=2) as (syncer, state_dir):
        honest = Rogue(fleet, syncer.address, "honest-seed")
        rogue = Rogue(fleet, syncer.address)
        try:
            text = seed_race(fleet, honest, rogue, state_dir, rng)
        finally:
            honest.close()
            rogue.close()
    m = fleet.next_merge("commit after the seed race")
    return f"port {syncer.port}", text + f"; fleet committed v{m['version']}"


def seed_vote(fleet: Fleet, rogue: Rogue, honest: list[Rogue], state_dir: Path,
              rng: random.Random) -> str:
    n = rogue.layout.numel
    bogus = np.full(n, 9.0, np.float32)
    theta0 = np.frombuffer(small_delta(n, rng), np.float32)
    joined = answered("the rogue's Join", lambda: rogue.join(init_sha256=seed_sha256(bogus)))
    if not joined.send_seed:
        raise FaultFailed("the rogue, first to join, was not asked for the seed")
    answered("the rogue's seed", lambda: rogue.push(rogue.header("f32", 0, kind=pb.SEED),
                                                    bogus.tobytes()))
    declared = dict(init_sha256=seed_sha256(theta0))
    for h in (*honest, honest[0]):  # the first again: the vote asks it for the seed
        again = answered(f"{h.lid}'s Join", partial(h.join, **declared))
    if not again.send_seed:
        raise FaultFailed(f"after the first quorum, {honest[0].lid} was not asked for the seed "
                          "when it joined again")
    reply = answered("the honest seed", lambda: honest[0].push(
        honest[0].header("f32", 0, kind=pb.SEED), theta0.tobytes()))
    if not reply.accepted:
        raise FaultFailed(f"the honest seed was not taken ({reply.status})")
    seeds = fleet.wait_for("two 'seeded' on the throwaway syncer's tape",
                           lambda: s if len(s := _seeded(state_dir)) >= 2 else None)
    if seeds[-1]["learner"] != honest[0].lid or \
            seeds[-1]["theta_sha256"] != state.digest(theta0):
        raise FaultFailed(f"Θ was last seeded by {seeds[-1]['learner']}, not the honest seed")
    return (f"the rogue seeded first (sha {seeds[0]['theta_sha256'][:12]}); the quorum "
            f"unseeded it and Θ = {honest[0].lid}'s seed (sha {seeds[-1]['theta_sha256'][:12]})")


def _seeded(state_dir: Path) -> list[dict]:
    return [r for r in records(state_dir / "tape.jsonl") if r.get("event") == "seeded"]


def inject_seed_vote(fleet: Fleet, rng: random.Random) -> tuple[str, str]:
    with throwaway_syncer(fleet, "seed-vote", quorum=3) as (syncer, state_dir):
        rogue = Rogue(fleet, syncer.address)
        honest = [Rogue(fleet, syncer.address, f"honest-{i}") for i in range(2)]
        try:
            text = seed_vote(fleet, rogue, honest, state_dir, rng)
        finally:
            for c in (rogue, *honest):
                c.close()
    m = fleet.next_merge("commit after the seed vote")
    return f"port {syncer.port}", text + f"; fleet committed v{m['version']}"


def observer_first(observer: Rogue, island: Rogue) -> str:
    answered("the observer's Join (first, another layout)", lambda: observer.join(observer=True))
    joined = answered("the island's Join after an observer of another layout", island.join)
    if not joined.send_seed:
        raise FaultFailed("the first island was not asked for the seed")
    got = []
    for what, call in (("Heartbeat", observer.version),
                       ("rejoin", lambda: observer.join(observer=True))):
        try:
            call()
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise FaultFailed(f"the observer's {what} refused with {e.code().name}: "
                                  f"{e.details()}") from None
            got.append(f"observer's {what} FAILED_PRECONDITION")
            continue
        raise FaultFailed(f"the observer's {what} after the island brought the layout: ACCEPTED")
    return "island accepted and asked for the seed; " + "; ".join(got)


def inject_observer_first(fleet: Fleet, rng: random.Random) -> tuple[str, str]:
    with throwaway_syncer(fleet, "observer-first", quorum=1) as (syncer, _):
        observer = Rogue(fleet, syncer.address, "rollout-0", layout_for(fleet.args.dim + 2))
        island = Rogue(fleet, syncer.address, "island-x")
        try:
            text = observer_first(observer, island)
        finally:
            observer.close()
            island.close()
    m = fleet.next_merge("commit after the observer race")
    return f"port {syncer.port}", text + f"; fleet committed v{m['version']}"


@dataclass(frozen=True)
class Kind:
    name: str
    inject: Callable[[Fleet, random.Random], tuple[str, str]] | None
    unavailable: Callable[[Fleet], str | None] = field(default=lambda fleet: None)


KINDS = (
    Kind("island-kill", inject_island_kill),
    Kind("syncer-kill", inject_syncer_kill),
    Kind("island-stop", inject_island_stop),
    Kind("silent-streams", inject_silent_streams),
    Kind("garbage", inject_garbage),
    Kind("direct-port", inject_direct_port),
    Kind("rogue-values", inject_rogue_values),
    Kind("impersonation", inject_impersonation),
    Kind("disk-full", inject_disk_full, lambda fleet: fleet.tmpfs_problem),
    Kind("link-cut", inject_link_cut),
    Kind("rogue-claims", inject_rogue_claims),
    Kind("rogue-bound", inject_rogue_bound),
    Kind("seed-race", inject_seed_race),
    Kind("observer-first", inject_observer_first),
    Kind("seed-vote", inject_seed_vote),
)


def schedule(kinds: list[Kind], n: int, rng: random.Random) -> list[Kind]:
    """Every kind once (shuffled), then kinds at random: n in all."""
    first = list(kinds)
    rng.shuffle(first)
    return (first + [rng.choice(kinds) for _ in range(max(0, n - len(first)))])[:n]


# ---- running the schedule -------------------------------------------------------------------
@dataclass
class Outcome:
    index: int
    kind: str
    target: str = "-"
    ok: bool = False
    text: str = ""
    versions: tuple[int, int] = (0, 0)  # tape versions when it began and ended


def log_exceptions(text: str) -> str:
    """The distinct exceptions logged in a stretch of the syncer's log (traceback ends)."""
    found = collections.Counter(m.group(1)[:120] for m in EXCEPTION.finditer(text))
    return "; ".join(f"{n}x {line}" if n > 1 else line for line, n in found.items())


def run_one(fleet: Fleet, kind: Kind, rng: random.Random, out: Outcome) -> bool:
    """Inject one fault; False when the fleet could not be brought back after it."""
    mark = fleet.log_size()
    try:
        out.target, out.text = kind.inject(fleet, rng)
        out.ok = True
    except (FaultFailed, ChaosError, grpc.RpcError, OSError, subprocess.TimeoutExpired) as e:
        out.text = f"{e.__class__.__name__}: {e}"
    healthy = True
    if not out.ok:
        try:
            healed = fleet.heal()
            fleet.next_merge("commit after healing the fleet")
            out.text += f" [healed: {', '.join(healed) or 'nothing to restart'}]"
        except (FaultFailed, ChaosError) as e:
            out.text += f" [NOT RECOVERED: {e}]"
            healthy = False
    raised = log_exceptions(fleet.log_since(mark))
    if raised:
        out.text += f" [syncer log: {raised}]"
    fleet.tape.poll()
    out.versions = (out.versions[0], fleet.tape.version)
    fleet.snapshot(f"after fault {out.index} ({kind.name})")
    return healthy


def run_schedule(fleet: Fleet, plan: list[Kind], rng: random.Random) -> list[Outcome]:
    outcomes = []
    for i, kind in enumerate(plan, 1):
        fleet.tape.poll()
        out = Outcome(i, kind.name, versions=(fleet.tape.version, 0))
        t0 = time.monotonic()
        healthy = run_one(fleet, kind, rng, out)
        outcomes.append(out)
        say(f"[{i:>3}/{len(plan)}] {kind.name:<14} {out.target:<10} "
            f"{'ok  ' if out.ok else 'FAIL'} {out.text} ({time.monotonic() - t0:.1f} s)")
        if not healthy:
            say(f"stopping the schedule after fault {i}: the fleet did not recover")
            break
    return outcomes


def finish_run(fleet: Fleet) -> list[str]:
    """Stop the syncer cleanly, resume it for --final-rounds more rounds, let every
    process exit by itself; problems found on the way."""
    problems = []
    if fleet.syncer is None or fleet.syncer.poll() is not None:
        fleet.heal()  # the schedule stopped on a fleet that did not recover: try once more
    mark = fleet.log_size()
    fleet.syncer.send_signal(signal.SIGTERM)
    try:
        code = fleet.syncer.wait(timeout=fleet.args.wait_s)
    except subprocess.TimeoutExpired:
        fleet.syncer.kill()
        code = f"nothing within {fleet.args.wait_s:.0f} s (killed)"
    if code != 0:
        problems.append(f"the syncer exited with {code} on SIGTERM")
    early = re.search(r"run finished at version (\d+)", fleet.log_since(mark))
    if early:
        say(f"note: on SIGTERM the syncer logged 'run finished at version {early.group(1)}' "
            f"(--rounds {OPEN_ROUNDS} not reached) and wrote final/: the islands' streams "
            "closed and a finished island ('rogue') was in its ledger")
    rec = fleet.resume_syncer("final", final_rounds=fleet.args.final_rounds)
    say(f"final: syncer stopped cleanly at v{rec['saved']} and resumed with --rounds "
        f"{rec['saved'] + fleet.args.final_rounds} --quorum {len(fleet.ids)} (not a fault)")
    fleet.ending = True
    for lid, p in fleet.islands.items():
        try:
            code = p.wait(timeout=fleet.args.wait_s * 2)
        except subprocess.TimeoutExpired:
            problems.append(f"{lid} did not exit within {fleet.args.wait_s * 2:.0f} s")
            continue
        if code != 0:
            problems.append(f"{lid} exited with {code}")
    try:
        code = fleet.syncer.wait(timeout=fleet.args.wait_s)
        if code != 0:
            problems.append(f"the syncer exited with {code} at the end")
    except subprocess.TimeoutExpired:
        problems.append(f"the syncer did not exit within {fleet.args.wait_s:.0f} s of the end")
        fleet.syncer.kill()
    fleet.tape.poll()
    return problems


# ---- the checks -----------------------------------------------------------------------------
def blame(outcomes: list[Outcome], version: int) -> str:
    for o in outcomes:
        if o.versions[0] < version <= o.versions[1] + 1:
            return f" (during fault {o.index} {o.kind})"
    return ""


def check_commits(fleet: Fleet, outcomes: list[Outcome], final_version: int | None) -> int:
    versions = [m["version"] for m in fleet.tape.merges]
    top = max(versions, default=0)
    counts = collections.Counter(versions)
    # a version on disk without its tape line: killed between the save and the tape
    # (the save comes first); the resumed syncer continued from it, so it is not lost
    untaped = [v for v in range(1, top + 1)
               if v not in counts and any(r >= v for r in fleet.tape.resumed)]
    missing = [v for v in range(1, top + 1) if v not in counts and v not in untaped]
    repeated = {v: c - 1 for v, c in counts.items() if c > 1}
    for v in untaped:
        say(f"  note: v{v} was saved and resumed from, but has no tape line (the syncer was "
            f"killed between its save and its tape){blame(outcomes, v)}")
    for v in missing:
        say(f"  lost: no merge record for v{v}{blame(outcomes, v)}")
    for v, extra in repeated.items():
        say(f"  lost: v{v} committed {extra + 1} times (the first was not saved?)"
            f"{blame(outcomes, v)}")
    for r in fleet.resumes:
        if r["tape"] > r["saved"]:
            say(f"  lost: the {r['why']} stop had the tape at v{r['tape']} but the state at "
                f"v{r['saved']}")
    seen = collections.defaultdict(set)
    for lid in fleet.ids:
        for r in records(fleet.records[lid]):
            if r.get("event") == "applied" and r.get("theta_sha256"):
                seen[r["version"]].add(r["theta_sha256"])
    diverged = sorted(v for v, shas in seen.items() if len(shas) > 1)
    for v in diverged:
        say(f"  lost: islands applied two different Θ as v{v}{blame(outcomes, v)}")
    behind = int(final_version is not None and final_version != top)
    if behind:
        say(f"  lost: the final state is v{final_version}, the tape ends at v{top}")
    if fleet.tape.torn:
        say(f"  note: {fleet.tape.torn} tape line(s) torn (not JSON)")
    return len(missing) + sum(repeated.values()) + len(diverged) + behind


def final_weights_digest(fleet: Fleet) -> str | None:
    path = fleet.state_dir / state.FINAL_DIR / "weights.safetensors"
    try:
        tensors, _ = state.read_safetensors(path)
        flat = [tensors[s.name].reshape(-1) for s in layout_for(fleet.args.dim).specs]
    except (OSError, ValueError, KeyError) as e:
        say(f"  final/: cannot read {path}: {e}")
        return None
    return state.digest(np.concatenate(flat).astype(np.float32))


def check_islands(fleet: Fleet, theta_sha: str | None) -> bool:
    final_sha = final_weights_digest(fleet)
    ok = theta_sha is not None and final_sha == theta_sha
    if theta_sha is not None and final_sha != theta_sha:
        say("  islands: final/ weights differ from the saved Θ")
    for lid in fleet.ids:
        done = [r for r in records(fleet.records[lid]) if r.get("event") == "done"]
        if not done or not done[-1].get("final"):
            say(f"  islands: {lid} has no final weights (its last run did not end with them)")
            ok = False
        elif done[-1]["weights_sha256"] != theta_sha:
            say(f"  islands: {lid}'s final weights differ from the syncer's")
            ok = False
    return ok


def check_theta(fleet: Fleet) -> tuple[bool, int | None, str | None]:
    """(Θ finite at every snapshot, the final state's version, its Θ digest)."""
    last = fleet.snapshot("final")
    for label, version, finite, _ in fleet.snapshots:
        if not finite:
            say(f"  theta: non-finite Θ or momentum at v{version} ({label})")
    if last is None:
        return False, None, None
    peak = max(s[3] for s in fleet.snapshots)
    say(f"  theta: {len(fleet.snapshots)} snapshots, max |Θ| {peak:.4g}")
    theta = state.load(fleet.state_dir)[0]
    return all(s[2] for s in fleet.snapshots), last[1], state.digest(theta)


# ---- drift: how far a rogue at its bounds moves Θ (in-process runs) ----------------------
ISLAND = island_parser()  # the synthetic island's defaults (--lr, --tokens), as in the fleet


class KeptTape(Tape):
    """A run's tape kept in memory (the drift runs have no state dir)."""

    def __init__(self):
        super().__init__(None)
        self.records: list[dict] = []

    def write(self, record: dict) -> bool:
        self.records.append(record)
        return True


@dataclass
class Drift:
    moved: float       # ‖Θ_R − Θ_0‖
    share: float       # the rogue's largest share of a merge (0: no rogue)
    stopped: str = ""  # why it ended before --drift-rounds rounds ("": it did not)


def drift_seed(layout: Layout, seed: int) -> np.ndarray:
    """Θ_0 as a LoRA adapter starts: lora_A small random values, lora_B zeros (before any
    other island pushed, the norm bound is 10 × its norm)."""
    theta = np.zeros(layout.numel, np.float32)
    a = layout.specs[0].numel  # lora_A comes first (layout_for)
    theta[:a] = 0.1 * np.random.default_rng(seed).standard_normal(a)
    return theta


def drift_push(run: Run, lid: str, gen: int, v: int, delta: np.ndarray, steps: int,
               tokens: int, seed: bool = False) -> None:
    """`lid`'s push against version `v` through the real Run.push (f32)."""
    n = run.layout.numel
    run.push(PushHeader(lid, gen, v + 1, 0, v, tokens, steps, "f32", n, 4 * n, seed, v),
             WholePush(np.ascontiguousarray(delta, np.float32).tobytes()))


def drift_run(args, honest: int, rogue: str = "") -> Drift:
    """--drift-rounds rounds of `honest` synthetic islands (Quadratic, seeds 0.., the
    fleet's lr, H = --sync-every and tokens) and, with `rogue` (a ROGUES name), the rogue;
    the first to join seeds Θ_0 (`drift_seed`)."""
    layout = layout_for(args.dim)
    run = Run(Config(quorum=honest + bool(rogue), outer=OUTER, outer_lr=OUTER_LR,
                     outer_momentum=OUTER_MOMENTUM, merge=args.drift_merge), tape=KeptTape())
    declared = {f"island-{i}": (ISLAND.get_default("tokens"), args.sync_every)
                for i in range(honest)}
    if rogue:
        declared["rogue"] = (ROGUE_TOKENS, ROGUE_EVERY)
    gens = {lid: run.join(lid, layout.specs, layout.fingerprint, "numpy", "weights.safetensors",
                          {}, tokens_per_step=t, sync_every=h)["generation"]
            for lid, (t, h) in declared.items()}
    theta0 = drift_seed(layout, args.seed)
    first = next(iter(gens))
    drift_push(run, first, gens[first], 0, theta0, 0, 0, seed=True)
    models = {lid: Quadratic(layout, i, ISLAND.get_default("lr"))
              for i, lid in enumerate(declared) if lid != "rogue"}
    stopped = drift_rounds(run, gens, models, args, ROGUES.get(rogue))
    shares = [rogue_share(r)[0] for r in run.tape.records if r.get("event") == "merge"]
    return Drift(float(np.linalg.norm(run.theta.astype(np.float64) - theta0)),
                 max(shares, default=0.0), stopped)


def rogue_at_norm_bound(honest: list[np.ndarray], direction: np.ndarray) -> np.ndarray:
    """±max_delta in one direction, far over the norm bound: summed at that bound."""
    return direction * BOUNDS.max_delta


def rogue_at_center_bound(honest: list[np.ndarray], direction: np.ndarray,
                          past: float = 1.0) -> np.ndarray:
    """At the centre bound (syncer.bounds, "The centre"): it sees the honest pushes of
    the round (it pushes last) and pushes their coordinate median plus `past` ×
    center_factor × their typical distance from it, in one direction (past 1: the
    syncer pulls it in to its bound as it measures it, with the rogue in the median)."""
    if len(honest) < 2:  # no centre to sit on: the norm bound is the bound
        return rogue_at_norm_bound(honest, direction)
    rows = np.stack(honest)
    center = np.median(rows, axis=0)
    distances = sorted(np.linalg.norm(rows - center, axis=1))
    typical = distances[(len(distances) - 1) // 2]
    return center + past * BOUNDS.center_factor * typical * direction / np.linalg.norm(direction)


CENTER_PAST = (1, 2, 3, 5)  # how far past its centre bound the rogue pushes (the worst counts)
ROGUES = {"norm bound": rogue_at_norm_bound,
          **{f"centre bound ×{m}": functools.partial(rogue_at_center_bound, past=m)
             for m in CENTER_PAST}}


def drift_rounds(run: Run, gens: dict[str, int], models: dict[str, Quadratic], args,
                 rogue: Callable[[list[np.ndarray], np.ndarray], np.ndarray] | None) -> str:
    """Each island pushes once a round, the honest ones first (H steps of their quadratic
    from Θ), then the `rogue` (if any): the most steps and tokens its declaration allows,
    what `rogue` makes of the honest pushes, in one direction all run long. Returns ""
    or why it stopped early (a refused push)."""
    h, tokens = args.sync_every, ISLAND.get_default("tokens")
    direction = rogue_direction(run.layout.numel, args.seed)
    for v in range(args.drift_rounds):
        theta, pushed = run.theta.copy(), []
        try:
            for lid, model in models.items():
                model.set(theta)
                for _ in range(h):
                    model.update()
                pushed.append(theta - model.w)
                drift_push(run, lid, gens[lid], v, pushed[-1], h, h * tokens)
            if rogue is not None:
                steps = 2 * ROGUE_EVERY  # within H × (2 + missed) whatever it missed
                drift_push(run, "rogue", gens["rogue"], v, rogue(pushed, direction), steps,
                           steps * ROGUE_TOKENS)
        except Reject as e:  # an island's push: the one being pushed when it raised
            return f"stopped in round {v + 1} ({e}): a lower bound"
        if run.version != v + 1:
            return f"round {v + 1} did not commit"
    return ""


def measure_drift(args) -> dict[str, float]:
    """rogue_drift_*: ‖Θ_R − Θ_0‖ with the rogue ÷ the same honest islands without it, for
    a minority rogue (beside max(3, --islands) honest ones: the largest of the rogues at
    the norm bound and at CENTER_PAST times the centre bound), half (beside one), alone
    (against one honest island alone)."""
    log = logging.getLogger("syncer")
    level, ratios, baseline = log.level, {}, {}
    log.setLevel(logging.ERROR)  # the norm bound's warning, every round
    cases = [("minority", max(3, args.islands), rogue) for rogue in ROGUES]
    cases += [("half", 1, "norm bound"), ("alone", 0, "norm bound")]
    try:
        for name, honest, rogue in cases:
            n = max(honest, 1)
            alone = baseline[n] = baseline.get(n) or drift_run(args, n)
            with_rogue = drift_run(args, honest, rogue)
            ratio = with_rogue.moved / alone.moved
            ratios[name] = max(ratio, ratios.get(name, 0.0))
            say(f"drift {name}: {honest} honest + the rogue at its {rogue} moved Θ "
                f"{with_rogue.moved:.4g}, {n} honest alone {alone.moved:.4g}: ratio "
                f"{ratio:.4g} (rogue's share ≤ {with_rogue.share:.4f})"
                f"{' ' + with_rogue.stopped if with_rogue.stopped else ''}"
                f"{' ' + alone.stopped if alone.stopped else ''}")
    finally:
        log.setLevel(level)
    return ratios


# ---- main -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m yeto.testing.chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default="", metavar="KIND,KIND",
                   help="only these fault kinds (default: every kind available here)")
    p.add_argument("--islands", type=int, default=3)
    p.add_argument("--quorum", type=int, default=2)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--sync-every", type=int, default=5)
    p.add_argument("--step-seconds", type=float, default=0.02)
    p.add_argument("--silent-streams", type=int, default=5,
                   help="header-only silent Push streams per fault (plus 2 empty ones)")
    p.add_argument("--final-rounds", type=int, default=3)
    p.add_argument("--bound-rounds", type=int, default=10,
                   help="rogue-bound: the rogue's pushes over the norm bound (one a round)")
    p.add_argument("--drift-rounds", type=int, default=100,
                   help="rounds of each in-process drift run (0: no drift figures)")
    p.add_argument("--drift-merge", choices=MERGE_RULES, default=Config.merge,
                   help="the merge rule of the drift runs only (default: the syncer's)")
    p.add_argument("--tmpfs-mib", type=int, default=16)
    p.add_argument("--wait-s", type=float, default=90.0, help="bound of every wait")
    p.add_argument("--workdir", type=Path, default=None,
                   help="logs, records and the state dir (default: a temporary folder, "
                        "kept when a check fails)")
    p.add_argument("--keep", action="store_true", help="keep the workdir")
    return p


def run(fleet: Fleet, args) -> int:
    fleet.mount_tmpfs()
    wanted = {k.strip() for k in args.kinds.split(",") if k.strip()}
    unknown = wanted - {k.name for k in KINDS}
    if unknown:
        raise ChaosError(f"unknown --kinds {', '.join(sorted(unknown))}; the kinds: "
                         + ", ".join(k.name for k in KINDS))
    kinds = [k for k in KINDS if k.unavailable(fleet) is None
             and (not wanted or k.name in wanted)]
    for k in KINDS:
        if k.unavailable(fleet) is not None:
            say(f"skip {k.name}: {k.unavailable(fleet)}")
    say(f"AVAILABLE kinds={len(kinds)} {' '.join(k.name for k in kinds)}")
    if not kinds:
        raise ChaosError("no fault kind left to inject (see the skips above)")
    rng = random.Random(args.seed)
    plan = schedule(kinds, args.faults, rng)
    fleet.start()
    say(f"fleet: syncer {fleet.address}, {len(fleet.ids)} islands, quorum {args.quorum}, "
        f"state {fleet.state_dir}{' (tmpfs)' if fleet.mounted else ''}; first commit done")
    outcomes = run_schedule(fleet, plan, rng)
    problems = []
    try:
        problems = finish_run(fleet)
    except (FaultFailed, ChaosError) as e:
        problems.append(f"the final rounds failed: {e}")
    drift = measure_drift(args) if args.drift_rounds > 0 else {}
    return report(fleet, outcomes, problems, drift)


def figure(x: float | None) -> str:
    return "-1" if x is None else f"{x:.4g}"


def share_figures(fleet: Fleet) -> tuple[float | None, float | None]:
    """rogue-claims: the rogue's largest share of a merge of k >= 3 islands, and the cap
    there (of any merge when none had k >= 3: then the cap is 1); a line for each."""
    wide = [s for s in fleet.shares if s[2] >= 3]
    for label, group in (("k >= 3", wide), ("k <= 2", [s for s in fleet.shares if s[2] < 3])):
        if group:
            v, share, k = max(group, key=lambda s: s[1])
            say(f"  shares: {len(group)} rogue-claims merge(s) with {label}: max share "
                f"{share:.4f} (v{v}, k={k}, cap {BOUNDS.share_cap(k):.4f})")
    if not fleet.shares:
        return None, None
    _, share, k = max(wide or fleet.shares, key=lambda s: s[1])
    return share, BOUNDS.share_cap(k)


def report(fleet: Fleet, outcomes: list[Outcome], problems: list[str],
           drift: dict[str, float]) -> int:
    say("checks:")
    for p in problems:
        say(f"  end: {p}")
    finite, final_version, theta_sha = check_theta(fleet)
    lost = check_commits(fleet, outcomes, final_version)
    identical = check_islands(fleet, theta_sha)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        say("FAILED faults: " + ", ".join(f"{o.index} {o.kind}" for o in failed))
    rounds = final_version if final_version is not None else fleet.tape.version
    kinds = len({o.kind for o in outcomes})
    share, cap = share_figures(fleet)
    say(f"logs and records: {fleet.workdir}")
    say(f"RESULT faults={len(outcomes)} kinds={kinds} rounds={rounds} lost_commits={lost} "
        f"theta_finite={int(finite)} islands_identical={int(identical)} "
        f"rogue_share_max={figure(share)} share_cap={figure(cap)} "
        f"rogue_drift_ratio={figure(drift.get('minority'))} "
        f"rogue_drift_half={figure(drift.get('half'))} "
        f"rogue_drift_alone={figure(drift.get('alone'))}")
    return int(bool(failed or problems or lost or not finite or not identical))


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 1 <= args.quorum < args.islands:
        parser.error("--quorum must be at least 1 and below --islands (the fleet goes on "
                     "while a fault takes one island out), e.g. --islands 3 --quorum 2")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="yeto-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    say(f"chaos: {args.faults} faults, seed {args.seed}, workdir {workdir}")
    fleet = Fleet(args, workdir)
    code = 2
    try:
        code = run(fleet, args)
    except (ChaosError, FaultFailed) as e:
        say(f"chaos: the fleet failed outside any fault: {e}")
        say(f"logs and records: {workdir}")
        say(f"RESULT faults=0 kinds=0 rounds={fleet.tape.version} lost_commits=-1 "
            "theta_finite=0 islands_identical=0 rogue_share_max=-1 share_cap=-1 "
            "rogue_drift_ratio=-1 rogue_drift_half=-1 rogue_drift_alone=-1")
    finally:
        fleet.close()
        if code == 0 and not args.keep and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)  # kept when anything failed
    return code


if __name__ == "__main__":
    sys.exit(main())
