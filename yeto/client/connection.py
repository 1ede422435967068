"""One island's link to the syncer: the gRPC channel and its credential, joining
(again after every failure, with exponential backoff and equal jitter) on a background
thread, and what the last join said: generation, fragments, the newest push the
syncer holds. `status` makes one Status call (for `yeto status`)."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from yeto import net, wire
from yeto.client.direct import DirectReader, NotDirect
from yeto.io import host_port
from yeto.layout import Layout
from yeto.proto import yeto_pb2 as pb
from yeto.proto import yeto_pb2_grpc as pb_grpc

log = logging.getLogger("yeto.client")

# status codes after which the same call would be refused again
REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)


@dataclass(frozen=True)
class TLSConfig:
    ca: bytes | None = None      # CA that signed the syncer's certificate
    cert: bytes | None = None    # client certificate (mutual TLS)
    key: bytes | None = None

    @classmethod
    def from_files(cls, ca=None, cert=None, key=None) -> TLSConfig | None:
        """TLS from PEM file paths (None when neither a CA nor a certificate is given)."""
        if not (ca or cert):
            return None
        return cls(*(Path(f).read_bytes() if f else None for f in (ca, cert, key)))


def open_channel(address: str, tls: TLSConfig | None = None,
                 keepalive_s: float = net.KEEPALIVE_S) -> grpc.Channel:
    target = host_port(*net.parse_address(address))
    options = net.client_options(keepalive_s)
    if tls is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key,
                                             certificate_chain=tls.cert)
        return grpc.secure_channel(target, creds, options=options)
    return grpc.insecure_channel(target, options=options)


def join_request(learner_id: str, layout: Layout, backend: str, weights_file: str,
                 export_files: dict[str, str] | None, tokens_per_step: int,
                 regime: str = "sft", sync_every: int = 0) -> pb.JoinRequest:
    """What an island says when it joins: who it is, the layout it trains, what it
    trains (`regime`: "sft" or "rl"; the syncer's default outer rule follows it) and
    how often it pushes (`sync_every` steps; 0: by time)."""
    return pb.JoinRequest(
        learner_id=learner_id, fingerprint=layout.fingerprint, backend=backend,
        tokens_per_step=max(0, int(tokens_per_step)), regime=regime,
        sync_every=max(0, int(sync_every)),
        weights_file=weights_file, export_files=export_files or {},
        layout=[pb.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype)
                for s in layout.specs])


class StreamEnded(grpc.RpcError):
    """The broadcast stream ended before the run did: reconnect."""

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "broadcast stream ended"


class Connection:
    """The channel, the credential, the join loop and what the last join said.

    `cond` is notified when the connection closes or is refused for good; the
    broadcast receiver notifies it too, so one wait sees all three. Kept up to date:
    `connected` (set while joined), `generation` (bumps on every rejoin), `run_id`,
    `num_fragments`, `acked_seq` (newest push seq the syncer holds), `fatal` (a refusal
    that retrying cannot fix), `last_error` (the newest connection error, for messages),
    `term` and `term_proof` (the newest syncer term heard and the run's signature of it:
    each join hands both on, and a syncer at an older term, a primary whose standby took
    the run over, fences itself and refuses), `direct_port` (the syncer's direct
    downlink, 0: none) and `via_direct` (the current broadcast stream reads it).
    """

    def __init__(self, address: str, learner_id: str, request: pb.JoinRequest, *,
                 token: str | None = None, tls: TLSConfig | None = None,
                 backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 keepalive_s: float = net.KEEPALIVE_S, channel: grpc.Channel | None = None,
                 cond: threading.Condition | None = None):
        """`address`: 'host:port', or several comma-separated (a primary syncer and its
        standbys, `syncer.standby`): after a failure the next one is tried. `cond`: the
        condition to notify (default: its own; the shards of a run share one, so a wait
        wakes on any shard's broadcast)."""
        self.addresses = [a.strip() for a in address.split(",") if a.strip()] or [address]
        self.learner_id, self.join_request = learner_id, request
        self.metadata = net.auth_metadata(
            net.credential_for(net.token_from_env(token), learner_id))
        self._tls, self._keepalive_s = tls, keepalive_s
        self._stream = None
        self._use(0, channel)
        self.backoff = (backoff_s, max_backoff_s)
        self.cond = cond if cond is not None else threading.Condition()
        self.connected = threading.Event()
        self.closed = False
        self.generation, self.run_id, self.num_fragments, self.acked_seq = 0, "", 1, -1
        self.term, self.term_proof = 0, b""
        self.direct_port = 0  # the last join's (0: broadcasts over Subscribe)
        self.via_direct = False  # the current broadcast stream is on the direct port
        self._unreachable: set[tuple[str, int]] = set()  # direct ports that did not answer
        self.fatal: str | None = None
        self.last_error: str | None = None

    def _use(self, i: int, channel: grpc.Channel | None = None) -> None:
        """Talk to `addresses[i]` from now on."""
        self.current, self.address = i, self.addresses[i]
        self.channel = channel if channel is not None else open_channel(
            self.address, self._tls, self._keepalive_s)
        self.stub = pb_grpc.SyncerStub(self.channel)
        # the push and broadcast streams without protobuf copies of the payload (yeto.wire)
        self.push_call = self.channel.stream_unary(
            "/yeto.v1.Syncer/Push", request_serializer=wire.passthrough,
            response_deserializer=pb.PushReply.FromString)
        self._subscribe_call = self.channel.unary_stream(
            "/yeto.v1.Syncer/Subscribe", request_serializer=pb.SubscribeRequest.SerializeToString,
            response_deserializer=wire.parse_broadcast_chunk)

    def _next_address(self) -> None:
        """After a failure: the next address, if there are several."""
        if len(self.addresses) < 2:
            return
        old = self.channel
        self._use((self.current + 1) % len(self.addresses))
        old.close()
        log.warning("trying the syncer at %s next", self.address)

    def start(self, session: Callable[[pb.JoinReply], None], over: Callable[[], bool]) -> None:
        """Join on a background thread and run `session(reply)` (seed, listen) after
        each join, until the run is `over()`, the syncer refuses for good, or `stop()`.
        `session` raises a `grpc.RpcError` to have the island join again."""
        self._thread = threading.Thread(target=self._loop, args=(session, over), daemon=True,
                                        name=f"yeto-client-{self.learner_id}")
        self._thread.start()

    def _loop(self, session, over) -> None:
        delay = self.backoff[0]
        while not self.closed and not over() and self.fatal is None:
            try:
                session(self._join())
                delay = self.backoff[0]
            except grpc.RpcError as e:
                self.connected.clear()
                if self.closed:
                    return
                if isinstance(e, NotDirect):
                    self._not_direct(str(e))
                self.last_error = f"{e.code().name}: {e.details()}"
                if e.code() in REFUSALS and self.generation == 0:
                    self._refused(e)
                    return
                self._next_address()
                # equal jitter (half the delay, plus up to half again at random): islands do not
                # retry in lockstep after a syncer restart
                wait = random.uniform(delay / 2, delay)
                log.warning("syncer %s unreachable (%s); retrying in %.1fs, training "
                            "continues locally", self.address, self.last_error, wait)
                if self._sleep(wait):
                    return
                delay = min(delay * 2, self.backoff[1])

    def _refused(self, e: grpc.RpcError) -> None:
        self.give_up(f"syncer at {self.address} refused {self.learner_id}: {e.details()}")

    def give_up(self, why: str) -> None:
        """A failure that retrying cannot fix: the island's part in the run ends."""
        self.fatal = why
        log.error("%s", why)
        with self.cond:
            self.cond.notify_all()

    def _sleep(self, seconds: float) -> bool:
        with self.cond:
            self.cond.wait_for(lambda: self.closed, timeout=seconds)
            return self.closed

    def _join(self) -> pb.JoinReply:
        request = pb.JoinRequest()
        request.CopyFrom(self.join_request)
        request.known_term, request.term_proof = self.term, self.term_proof
        reply = self.stub.Join(request, metadata=self.metadata, timeout=30)
        if reply.term > self.term:
            self.term, self.term_proof = reply.term, reply.term_proof
        if reply.finished:
            log.info("syncer reports the run already finished")
        self.generation, self.run_id = reply.generation, reply.run_id
        self.num_fragments = max(1, reply.num_fragments)
        self.acked_seq = reply.last_seq
        self.direct_port = reply.direct_port
        self.connected.set()
        log.info("joined syncer %s as %s (generation %d, %d/%d islands, version %d)",
                 self.address, self.learner_id, reply.generation, reply.joined, reply.quorum,
                 reply.version)
        return reply

    def subscribe(self):
        """This connection's broadcast stream; a new one starts from the current Θ (a
        rejoined island catches up). On the syncer's direct port when it offers one
        and this island reaches it (`yeto.client.direct`), else over Subscribe."""
        port = self.direct_port
        if port and self._tls is None and (self.address, port) not in self._unreachable:
            host = net.parse_address(self.address)[0]
            try:
                self._stream = DirectReader.open(host, port, pb.DirectHello(
                    learner_id=self.learner_id, generation=self.generation,
                    authorization=dict(self.metadata).get(net.AUTH_KEY, ""),
                    run_id=self.run_id), self._keepalive_s)
                self.via_direct = True
                return self._stream
            except OSError as e:
                self._not_direct(f"unreachable ({e})")
        self.via_direct = False
        self._stream = self._subscribe_call(
            pb.SubscribeRequest(learner_id=self.learner_id, generation=self.generation),
            metadata=self.metadata)
        return self._stream

    def _not_direct(self, why: str) -> None:
        """This address's direct port cannot be used: broadcasts over gRPC from now on."""
        port = self.direct_port
        self._unreachable.add((self.address, port))
        log.warning("the syncer's direct port %s: %s; broadcasts come over gRPC (open that "
                    "port to the islands for the faster path, or fix it with the syncer's "
                    "--direct-port)", host_port(net.parse_address(self.address)[0], port), why)

    def stop(self) -> None:
        """No more joins; waiters wake up."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def close(self) -> None:
        """Cancel the broadcast stream and close the channel (after `stop`)."""
        if self._stream is not None:
            self._stream.cancel()
        self.channel.close()


def status(address: str, token: str | None = None, tls: TLSConfig | None = None,
           timeout: float = 10) -> dict:
    """One Status call, as a plain dict with numbers as numbers (`yeto status`, a
    dashboard over shards, tests)."""
    from google.protobuf.json_format import MessageToDict

    with open_channel(address, tls) as ch:
        reply = pb_grpc.SyncerStub(ch).Status(pb.StatusRequest(),
                                              metadata=net.auth_metadata(
                                                  net.token_from_env(token)), timeout=timeout)
    return _normalized(MessageToDict(reply, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True))


def _normalized(s: dict) -> dict:
    """protobuf's JSON mapping writes 64-bit integers as strings: make them ints."""
    ints = ("round", "version", "quorum", "bytes_in", "bytes_out", "pushes", "loss_tokens",
            "generation", "shard", "shards")
    out = {k: (int(v) if k in ints and isinstance(v, str) else v) for k, v in s.items()}
    out["islands"] = [_normalized(i) for i in s.get("islands", [])]
    return out


def merged_islands(shards: list[dict]) -> list[dict]:
    """Each island once over the `status` of every shard of a run: pushes and loss
    tokens summed (a shard counts a push to each of its fragments; loss tokens only
    where fragment 0 lives), the newest contact, and the state of its row on the first
    shard that has one."""
    out: dict[str, dict] = {}
    for s in shards:
        for i in s["islands"]:
            row = out.setdefault(i["learner_id"], dict(i, pushes=0, loss_tokens=0))
            row["pushes"] += i.get("pushes", 0)
            row["loss_tokens"] += i.get("loss_tokens", 0)
            row["last_contact_s"] = min(row.get("last_contact_s", i.get("last_contact_s", 0)),
                                        i.get("last_contact_s", 0))
    return list(out.values())
