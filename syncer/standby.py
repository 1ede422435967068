"""Standby syncers: a second syncer that holds every committed state and takes the run
over when the primary stops answering.

    primary   python -m syncer --state-dir A --port 7000 ...
    standby   python -m syncer --state-dir B --port 7001 --standby-of HOST:7000 ...
    islands   --syncer HOST:7000,HOST:7001

The standby says it is there every second (`RegisterStandby`, with the address the
primary reaches it at). The primary sends each committed state to every standby it
knows as it saves it, before the round is published (`Standbys.replicate`: a commit an
island has seen is on the standby's disk too; a standby that cannot take it within its
deadline is dropped and logged, and the run goes on with one copy). The standby checks a
received state as `--resume` would (digests, the run's secret) before it replaces its
own. When the primary has not answered for `--takeover-after-s`, the standby resumes
the run from the newest state it holds and serves it on its own port: islands, which
hold both addresses, move to it on their own and rejoin as after a syncer restart
(pushes it does not hold are sent again). Its tape says so ("takeover"); the primary's
says when each standby registered.

Fencing by term: a takeover raises the run's term by one (saved in the state before the
new primary serves anyone), every join reply tells islands the term with the run's
signature of it (`yeto.net.term_proof`, keyed by the run secret), and every join
carries the newest signed term the island has heard (a term without the signature is
refused and fences nothing: one credential cannot stop the run). A primary that was
frozen or cut off while its standby took over, and answers again, is fenced by the first
island that joins it from the new primary: it refuses the join as unavailable (the
island moves on), tapes "fenced" and exits non-zero, committing nothing more.

Not covered: islands that never reach the new primary (a partition that keeps some
islands with the old one: both sides commit, unless --quorum is more than half of
the islands, so that only one side can), and state files bigger than one transfer
within the deadline.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NoReturn, TypeVar

import grpc

from syncer import state
from syncer.errors import Reject
from syncer.tape import Tape
from yeto import net
from yeto.client.connection import TLSConfig, open_channel
from yeto.io import atomic_file
from yeto.proto import yeto_pb2 as pb
from yeto.proto import yeto_pb2_grpc as pb_grpc

log = logging.getLogger("syncer")
T = TypeVar("T")

CHUNK = 1 << 20            # bytes of the state file per ReplicateChunk
REGISTER_EVERY_S = 1.0      # a standby's RegisterStandby period
MIN_RATE = 20e6             # bytes/s a replica must at least move at (its deadline)
INCOMING = ".incoming"      # where a standby checks a received state before using it


def peer_tls(cert: bytes, key: bytes, ca: bytes | None) -> TLSConfig:
    """How a syncer serving TLS (`cert`, `key`; `ca`: its --tls-ca, if any) dials the
    other syncer of a primary-standby pair: it trusts `ca`, or without one the
    certificate it serves itself (both syncers then serve one certificate, which names
    both hosts), and presents its own certificate, so a peer that asks islands for
    client certificates gets one too."""
    return TLSConfig(ca=ca or cert, cert=cert, key=key)


def _deadline_s(size: int) -> float:
    return 30.0 + size / MIN_RATE


class Standbys:
    """The primary's standbys: who registered, and sending them each saved state."""

    def __init__(self, state_path: Path, token: str | None, tape: Tape,
                 tls: TLSConfig | None = None):
        self.path, self.tape, self.tls = state_path, tape, tls
        self.metadata = net.auth_metadata(token)
        self._lock = threading.Lock()
        self._known: dict[str, int] = {}  # address -> the version it acknowledged
        self._told: set[str] = set()  # those told the run finished (they stop)

    def register(self, address: str, version: int, current: int, finished: bool = False
                 ) -> bool:
        """A standby at `address` holds `version`; returns whether it is new (then it is
        sent the current state, `current`, at once, on a thread of its own). `finished`:
        the run has finished, which its reply tells it."""
        with self._lock:
            new = address not in self._known
            self._known[address] = max(version, self._known.get(address, 0))
            if finished:
                self._told.add(address)
        if new:
            log.info("standby %s registered (holds version %d)", address, version)
            self.tape.event("standby", address=address, version=version)
            if version < current and self.path.exists():
                threading.Thread(target=self._send_quietly, args=(address, current),
                                 name=f"standby-bootstrap-{address}", daemon=True).start()
        return new

    def replicate(self, version: int) -> None:
        """Send the state file just saved (as of `version`) to every standby; one that
        fails is dropped until it registers again."""
        with self._lock:
            targets = list(self._known)
        for address in targets:
            try:
                self.send(address, version)
            except grpc.RpcError as e:
                with self._lock:
                    self._known.pop(address, None)
                log.error("standby %s did not take version %d (%s: %s); dropped until it "
                          "registers again: the run goes on with one copy of its state",
                          address, version, e.code().name, e.details())

    def send(self, address: str, version: int) -> int:
        """Stream the state file to `address`; returns the version it acknowledged."""
        size = self.path.stat().st_size
        with open_channel(address, self.tls) as channel:
            reply = pb_grpc.SyncerStub(channel).Replicate(
                _chunks(self.path, version, size), metadata=self.metadata,
                timeout=_deadline_s(size))
        with self._lock:
            if address in self._known:
                self._known[address] = max(self._known[address], reply.version)
        return int(reply.version)

    def _send_quietly(self, address: str, version: int) -> None:
        try:
            self.send(address, version)
        except grpc.RpcError as e:
            log.warning("standby %s: sending it the current state failed (%s); it gets "
                        "the next one", address, e.code().name)

    def known(self) -> dict[str, int]:
        with self._lock:
            return dict(self._known)

    def all_told(self) -> bool:
        """Every standby known has been told the run finished."""
        with self._lock:
            return set(self._known) <= self._told


def _chunks(path: Path, version: int, size: int) -> Iterator[pb.ReplicateChunk]:
    with open(path, "rb") as f:
        first = True
        while True:
            data = f.read(CHUNK)
            if not data and not first:
                return
            yield pb.ReplicateChunk(version=version if first else 0,
                                    size=size if first else 0, data=data)
            first = False


class Standby:
    """The standby side: the newest state it holds, and whether the primary answers."""

    def __init__(self, state_dir: Path, key: state.StateKey, primary: str, advertise: str,
                 takeover_after_s: float, max_bytes: int, tls: TLSConfig | None = None):
        self.dir, self.key, self.primary, self.advertise = state_dir, key, primary, advertise
        self.tls = tls  # how it dials the primary (`peer_tls`; None: plaintext)
        self.takeover_after_s, self.max_bytes = takeover_after_s, max_bytes
        self._lock = threading.Lock()
        self.version = self._held_version()
        self.run_id = ""

    def _held_version(self) -> int:
        if not (self.dir / state.STATE_FILE).exists():
            return 0
        return int(state.load(self.dir, self.key)[3]["version"])

    def receive(self, chunks: Iterator[pb.ReplicateChunk]) -> int:
        """A state from the primary: written aside, checked as --resume would, then made
        the state this standby holds (unless it holds a newer one). Returns the version
        held now."""
        first = next(chunks, None)
        if first is None or first.size <= 0:
            raise Reject("invalid", "a replica starts with a chunk naming its version and size")
        if first.size > self.max_bytes:
            raise Reject("invalid", f"a replica of {first.size} bytes is over this standby's "
                         f"bound ({self.max_bytes}: --max-params)")
        incoming = self.dir / INCOMING
        incoming.mkdir(mode=0o700, exist_ok=True)
        got = 0
        with self._lock, atomic_file(incoming / state.STATE_FILE) as f:
            for chunk in _with(first, chunks):
                got += len(chunk.data)
                if got > first.size:
                    raise Reject("invalid", f"a replica longer than the {first.size} bytes "
                                 "it announced")
                f.write(chunk.data)
            if got != first.size:
                raise Reject("invalid", f"a replica ended after {got} of {first.size} bytes")
        with self._lock:
            try:
                meta = state.load(incoming, self.key)[3]
            except state.StateError as e:
                raise Reject("invalid", f"the replica is not a state of this run: {e}") from None
            if int(meta["version"]) > self.version:
                os.replace(incoming / state.STATE_FILE, self.dir / state.STATE_FILE)
                _fsync_dir(self.dir)
                self.version, self.run_id = int(meta["version"]), str(meta["run_id"])
                log.info("standby holds version %d of run %s", self.version, self.run_id)
            return self.version

    def watch(self, stop: threading.Event, token: str | None) -> bool:
        """Register with the primary every second until it has not answered for
        `takeover_after_s` (True: take over), or it says the run finished, or `stop` is
        set (False)."""
        metadata = net.auth_metadata(token)
        last_ok = time.monotonic()
        with open_channel(self.primary, self.tls) as channel:
            stub = pb_grpc.SyncerStub(channel)
            while not stop.wait(REGISTER_EVERY_S):
                try:
                    reply = stub.RegisterStandby(pb.RegisterStandbyRequest(
                        address=self.advertise, version=self.version), metadata=metadata,
                        timeout=max(1.0, REGISTER_EVERY_S * 2))
                    last_ok = time.monotonic()
                    self.run_id = reply.run_id or self.run_id
                    if reply.finished:
                        log.info("the primary %s finished the run at version %d: this "
                                 "standby stops", self.primary, reply.version)
                        return False
                except grpc.RpcError as e:
                    if e.code() in (grpc.StatusCode.UNAUTHENTICATED,
                                    grpc.StatusCode.PERMISSION_DENIED):
                        why = f"the primary {self.primary} refused this standby: {e.details()}"
                        raise SystemExit(f"error: {why}; pass the run's --token") from None
                    silent = time.monotonic() - last_ok
                    if silent >= self.takeover_after_s:
                        if self.version == 0:
                            log.error("the primary %s has not answered for %.0f s, but this "
                                      "standby holds no state yet: waiting", self.primary,
                                      silent)
                            continue
                        return True
        return False


def _with(first: T, rest: Iterable[T]) -> Iterator[T]:
    yield first
    yield from rest


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StandbyService(pb_grpc.SyncerServicer):
    """What a standby answers: replicas from the primary (with the run's secret), its
    status; every island call is UNAVAILABLE, naming the primary, so islands move on
    to the next address they hold."""

    def __init__(self, standby: Standby, token: str | None):
        self.standby, self.token = standby, token

    def _operator(self, context: grpc.ServicerContext) -> None:
        if self.token is None:
            return
        got = dict(context.invocation_metadata() or ()).get(net.AUTH_KEY, "")
        if got != f"Bearer {self.token}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "a replica needs the run's secret "
                          "(--token / $YETO_TOKEN)")

    def Replicate(self, request_iterator: Iterator[pb.ReplicateChunk], context: grpc.ServicerContext
                  ) -> pb.ReplicateReply:
        self._operator(context)
        try:
            return pb.ReplicateReply(version=self.standby.receive(request_iterator))
        except Reject as e:
            context.abort(e.status, str(e))

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        s = self.standby
        return pb.StatusReply(run_id=s.run_id, version=s.version,
                              problem=f"standby of {s.primary} (holds version {s.version}); "
                                      "it serves the run once the primary stops answering")

    def _elsewhere(self, context: grpc.ServicerContext) -> NoReturn:
        context.abort(grpc.StatusCode.UNAVAILABLE, f"this is a standby of {self.standby.primary}: "
                      "it serves the run once the primary stops answering")

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        self._elsewhere(context)

    def Push(self, request_iterator: Iterator[pb.PushChunk], context: grpc.ServicerContext
             ) -> pb.PushReply:
        self._elsewhere(context)

    def Subscribe(self, request: pb.SubscribeRequest, context: grpc.ServicerContext
                  ) -> Iterator[pb.BroadcastChunk]:
        self._elsewhere(context)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
                  ) -> pb.HeartbeatReply:
        self._elsewhere(context)

    def Finish(self, request: pb.FinishRequest, context: grpc.ServicerContext) -> pb.FinishReply:
        self._elsewhere(context)

    def RegisterStandby(self, request: pb.RegisterStandbyRequest, context: grpc.ServicerContext
                        ) -> pb.RegisterStandbyReply:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this is a standby, not a primary")
