"""What islands and the syncer share about the network: chunking, auth, addresses."""

from __future__ import annotations

import argparse
import hashlib
import hmac
import ipaddress
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path

from yeto.codec.chunked import ranges

# Pushes and broadcasts go in 1 MiB messages. A push: the syncer receives every
# island's push at once, and each stream holds a few messages in flight (gRPC's
# buffers, the parsed message, its copy to the spill file), so the message size
# multiplies with the islands in the syncer's memory. A broadcast: each message is
# built from Θ, sent, checked and applied while it is still in the cache, and the
# sender and the receiver overlap more finely. The measurements behind the size:
# BENCHMARKS.md, "Memory: bytes per parameter" (push messages of 1 MiB) and "Spine,
# island and fault benchmarks" (bench_transfer).
CHUNK_BYTES = 1 << 20
# The largest message either side accepts: 4 MiB of payload plus its header.
MAX_MESSAGE_BYTES = (4 << 20) + (1 << 20)
AUTH_KEY = "authorization"
DEFAULT_PORT = 29400
TOKEN_ENV = "YETO_TOKEN"

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# An island pings the syncer after this many seconds without traffic and declares the
# link down when as many more pass without an answer: a link that dies silently (a NAT
# that forgets the connection, a cable pulled mid-round, a laptop lid) is noticed, the
# island trains on offline and reconnects, instead of waiting on a dead connection.
KEEPALIVE_S = 20.0
# The syncer accepts such pings as often as once a second, for as long as they come
# (gRPC's default answers pings more frequent than 5 minutes with GOAWAY).
# The syncer pings its peers too (every SERVER_KEEPALIVE_S, answer within as long): a
# peer that stopped answering (a frozen process, a dead link) loses its connection and
# the worker threads its streams held.
SERVER_KEEPALIVE_S = 30.0
SERVER_OPTIONS = GRPC_OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.keepalive_time_ms", int(SERVER_KEEPALIVE_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(SERVER_KEEPALIVE_S * 1000)),
]


def keep_alive(sock: socket.socket, idle_s: float) -> None:
    """TCP keepalive on a plain socket (the direct downlink), as gRPC's pings do on its
    connections: probed after `idle_s` of silence, dropped when `idle_s` more pass
    without an answer (Linux and macOS; elsewhere the system's defaults)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, probes = max(1, int(idle_s)), 4
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPALIVE", idle),
                        ("TCP_KEEPINTVL", max(1, idle // probes)), ("TCP_KEEPCNT", probes)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def port(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free port) to 65535 (gRPC and sockets would
    otherwise wrap 70000 to 4464 without a word)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is out of range: use 0 (any free "
                                         "port) to 65535")
    return value


def client_options(keepalive_s: float = KEEPALIVE_S) -> list[tuple[str, int]]:
    """Channel options of an island's (or observer's) connection to the syncer."""
    ms = int(keepalive_s * 1000)  # at least 1 s: IslandConfig.check
    return GRPC_OPTIONS + [("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", ms),
                           ("grpc.keepalive_permit_without_calls", 1),
                           ("grpc.http2.max_pings_without_data", 0)]


def chunks(payload: bytes | memoryview, size: int = CHUNK_BYTES) -> Iterator[memoryview]:
    """Zero-copy slices of a payload; at least one (possibly empty) slice."""
    view = memoryview(payload)
    if len(view) == 0:
        yield view
        return
    for lo, hi in ranges(0, len(view), size):
        yield view[lo:hi]


LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost",
                            "ip6-loopback"})


def ip_address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """`host` as an IP address ('[::1]' too), or None when it is a name."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def is_loopback(host: str, resolve: bool = False) -> bool:
    """A loopback address (127.0.0.0/8, ::1) or name (localhost); with `resolve`, also
    a name this machine resolves to a loopback address."""
    ip = ip_address(host)
    if ip is not None:
        return ip.is_loopback
    if host.lower() in LOOPBACK_NAMES:
        return True
    if not resolve or not host:
        return False
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except OSError:
        return False


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((AUTH_KEY, f"Bearer {token}"),) if token else ()


# An island's credential: `isl1:<learner id>:<HMAC-SHA256(run secret, learner id)>`.
# The syncer derives it again from the run's secret (it keeps no list of islands), so
# a credential is good for its own learner id only; whoever holds the run's secret
# (the operator) can derive every island's.
CREDENTIAL_PREFIX = "isl1:"


def island_credential(secret: str, learner_id: str) -> str:
    """The credential of island `learner_id` in the run whose secret is `secret`."""
    mac = hmac.new(secret.encode(), learner_id.encode(), hashlib.sha256).hexdigest()
    return f"{CREDENTIAL_PREFIX}{learner_id}:{mac}"


def credential_id(token: str) -> str | None:
    """The learner id an island credential names (None: not a credential)."""
    if not token.startswith(CREDENTIAL_PREFIX):
        return None
    learner, sep, mac = token[len(CREDENTIAL_PREFIX):].rpartition(":")
    return learner if sep and learner and len(mac) == 64 else None


def credential_for(token: str | None, learner_id: str) -> str | None:
    """What island `learner_id` sends: its credential, derived when `token` is the
    run's secret, as given when it is already a credential (checked to be its own)."""
    if not token:
        return None
    owner = credential_id(token)
    if owner is None:
        return island_credential(token, learner_id)
    if owner != learner_id:
        raise ValueError(f"the credential given is island {owner!r}'s, not {learner_id!r}'s: "
                         f"start this island with --learner-id {owner}, or pass its own "
                         "credential (yeto launch prints one per island)")
    return token


def term_proof(secret: str, run_id: str, term: int) -> bytes:
    """The run's signature of `term` (syncer.standby, fencing): a syncer that took the run
    over hands it to islands with its term, and a syncer at an older term believes a
    newer term only with it, so no island can fence a syncer with a term it made up.
    (The NUL keeps it apart from every island credential: ids hold no NUL.)"""
    msg = f"yeto-term\0{run_id}\0{int(term)}".encode()
    return hmac.new(secret.encode(), msg, hashlib.sha256).digest()


def credential_valid(secret: str, token: str) -> str | None:
    """The learner id `token` authenticates under `secret`, or None."""
    learner = credential_id(token)
    if learner is None:
        return None
    return learner if hmac.compare_digest(island_credential(secret, learner), token) else None


def token_from_env(token: str | None) -> str | None:
    return token or os.environ.get(TOKEN_ENV) or None


def shard_entries(syncer: str) -> list[str]:
    """The entries of a run's syncer list, one per shard in order ('A;B'; each entry may
    list a shard's standbys after commas: 'A,A2;B,B2')."""
    return [e.strip() for e in syncer.split(";") if e.strip()]


def parse_address(address: str) -> tuple[str, int]:
    """'host:port' or 'host' (default port); '[::1]:29400' for IPv6."""
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        port = rest.lstrip(":")
    else:
        host, sep, port = address.rpartition(":")
        if not sep:
            host, port = address, ""
    if not host:
        raise ValueError(f"syncer address {address!r} has no host; "
                         "example: --syncer 127.0.0.1:29400")
    try:
        return host, int(port) if port else DEFAULT_PORT
    except ValueError:
        raise ValueError(f"syncer address {address!r} has a bad port; example: "
                         f"--syncer 127.0.0.1:{DEFAULT_PORT}") from None


# ---- TLS files ---------------------------------------------------------------------------
# A self-signed certificate for a syncer that islands reach as 127.0.0.1 (put the
# address islands dial in subjectAltName); islands pass the .pem as --tls-ca.
SELF_SIGNED = ("openssl req -x509 -newkey rsa:2048 -nodes -keyout server.key -out server.pem "
               "-days 365 -subj /CN=localhost -addext subjectAltName=IP:127.0.0.1")
_PEM_BEGIN = re.compile(rb"^-----BEGIN ([A-Z0-9 ]+)-----", re.MULTILINE)


class TLSFileError(ValueError):
    """A TLS file that is missing, unreadable or not PEM; the message names the file
    and what to do."""


def read_pem(path: str | Path, flag: str) -> bytes:
    """The bytes of the PEM file passed as `flag` (--tls-cert, --tls-key, --tls-ca),
    checked up front: gRPC reads them only at the first handshake, and fails there far
    from the flag. --tls-key must hold a private key, the others a certificate."""
    path = Path(path)
    want = "PRIVATE KEY" if flag.endswith("key") else "CERTIFICATE"
    what = "private key" if want == "PRIVATE KEY" else "certificate"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TLSFileError(f"{flag} {path}: no such file: pass the PEM {what}'s path (a "
                           f"self-signed pair for a test: {SELF_SIGNED})") from None
    except OSError as e:
        raise TLSFileError(f"{flag} {path}: cannot read it ({e.strerror}): pass a readable "
                           f"PEM {what}") from None
    labels = [m.decode() for m in _PEM_BEGIN.findall(data)]
    if not labels:
        der = "pkey" if what == "private key" else "x509"
        pem = path.with_suffix(".pem") if path.suffix != ".pem" else path.with_suffix(".new.pem")
        raise TLSFileError(f"{flag} {path} is not a PEM file (no '-----BEGIN' line): pass the "
                           f"PEM {what}; a DER one converts with: openssl {der} -inform der "
                           f"-in {path} -out {pem}")
    if not any(want in label for label in labels):
        fix = ("pass the CA's certificate" if flag == "--tls-ca"
               else "are --tls-cert and --tls-key swapped?")
        raise TLSFileError(f"{flag} {path} holds {labels[0]}, not a {what}: {fix}")
    if want == "PRIVATE KEY" and all("ENCRYPTED" in label for label in labels
                                     if want in label):
        raise TLSFileError(f"{flag} {path} is encrypted and gRPC takes no passphrase: "
                           f"decrypt it with: openssl pkey -in {path} -out "
                           f"{path.with_suffix('.plain.key')}")
    return data


def client_tls_files(ca: str | Path | None = None, cert: str | Path | None = None,
                     key: str | Path | None = None) -> tuple[bytes | None, ...] | None:
    """(ca, cert, key) PEM bytes of an island's or observer's --tls-* flags, each
    checked (`read_pem`), or None when none is given; `TLSFileError` otherwise."""
    if bool(cert) != bool(key):
        raise TLSFileError("--tls-cert and --tls-key go together (mutual TLS: the client's "
                           "certificate and its key), e.g. --tls-cert island.pem --tls-key "
                           "island.key")
    if not (ca or cert):
        return None
    return tuple(read_pem(f, flag) if f else None
                 for f, flag in ((ca, "--tls-ca"), (cert, "--tls-cert"), (key, "--tls-key")))
