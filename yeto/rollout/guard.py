"""Who may call a rollout node, and where it may load adapters from.

A node speaks plain HTTP and, on loopback, needs no API key by default; what keeps
a web page the user happens to open from driving it is here. Browsers mark what
they send: a cross-origin request carries ``Origin``; a DNS-rebinding page reaches
127.0.0.1 under the attacker's own name (``Host: evil.example:8080``); and a page
may POST ``text/plain`` to any origin without asking, while ``application/json``
needs a CORS preflight that the node never grants. So a node answers only requests
whose Host is one of its own names, whose Origin (if any) is the node itself, and
whose POST body is declared ``application/json``. An adapter is loaded only from
under the node's adapter roots (``--adapter-root``), after symlinks and ``..`` are
resolved.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from yeto.net import ip_address, is_loopback
from yeto.rollout.api import ApiError

WILDCARDS = frozenset({"", "0.0.0.0", "::"})
JSON_TYPE = "application/json"
_DEFAULT_PORTS = {"http": 80, "https": 443}



def _host_port(value: str) -> tuple[str, int | None] | None:
    """(lower-case host, port) of a Host header value; None when malformed."""
    if not value or any(c in value for c in "@/?#\\ \t"):
        return None
    try:
        u = urlsplit("//" + value)
        return (u.hostname, u.port) if u.hostname else None
    except ValueError:
        return None


def _forbidden(message: str) -> ApiError:
    return ApiError(403, message, "PermissionDeniedError")


@dataclass(frozen=True)
class Guard:
    """The Host, Origin and Content-Type rules of a node listening on `port`."""

    port: int
    names: frozenset[str]      # its own names besides the loopback ones
    any_ip: bool = False       # bound to a wildcard: every address literal is its own
    any_host: bool = False     # --allow-host '*'

    @classmethod
    def for_bind(cls, host: str, port: int, allow: Iterable[str] = ()) -> Guard:
        """The rules of a node bound to `host`: loopback names and the bound address;
        beyond loopback also this machine's host names; plus the `allow` names."""
        allow = [a.strip().lower() for a in allow if a.strip()]
        bound = host.strip("[]").lower()
        names = {bound} | {a for a in allow if a != "*"}
        if not is_loopback(bound):
            names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        return cls(port, frozenset(names - WILDCARDS), bound in WILDCARDS, "*" in allow)

    def own(self, host: str) -> bool:
        """Whether `host` (a name or address, no port) names this node."""
        return (self.any_host or is_loopback(host) or host in self.names
                or (self.any_ip and ip_address(host) is not None))

    def check(self, headers: Mapping[str, str], post: bool) -> None:
        """Raise `ApiError` (403, 415) for a request this node must not answer."""
        host = headers.get("Host")
        parsed = None if host is None else _host_port(host)
        if host is not None and (parsed is None or not self.own(parsed[0])):
            raise _forbidden(
                f"Host {host!r} does not name this node (DNS-rebinding guard): call it as "
                f"127.0.0.1:{self.port} or localhost:{self.port}, or start the node with "
                "--allow-host NAME for a name it is reached by")
        origin = headers.get("Origin")
        if origin is not None and not self._own_origin(origin):
            raise _forbidden(
                f"cross-origin request refused: Origin {origin!r} is not this node; rollout "
                "nodes serve programs, not web pages from other origins: send the request "
                "without an Origin header (curl, an HTTP client library)")
        if post:
            ctype = headers.get("Content-Type") or ""
            if ctype.split(";", 1)[0].strip().lower() != JSON_TYPE:
                raise ApiError(415, f"a POST body must be JSON, sent with 'Content-Type: "
                               f"{JSON_TYPE}' (got {ctype or 'no Content-Type'!r})",
                               "UnsupportedMediaTypeError")

    def _own_origin(self, origin: str) -> bool:
        try:
            u = urlsplit(origin)
            port = u.port or _DEFAULT_PORTS.get(u.scheme)
        except ValueError:
            return False
        return (u.scheme in _DEFAULT_PORTS and bool(u.hostname) and u.path in ("", "/")
                and self.own(u.hostname) and port == self.port)


# ---- adapter roots -----------------------------------------------------------------
def resolve_roots(roots: Iterable[str | Path]) -> tuple[Path, ...]:
    """The adapter roots as real directories (symlinks and `..` resolved), once each."""
    out: list[Path] = []
    for r in roots:
        real = Path(r).resolve()
        if real not in out:
            out.append(real)
    return tuple(out)


def adapter_dir(path: str, roots: Sequence[Path]) -> Path:
    """`path` resolved (symlinks, ``..``), if it lies under one of `roots` (resolved
    by `resolve_roots`); `ApiError` 403 if not, 400 if it cannot be resolved."""
    try:
        real = Path(path).resolve()
    except (OSError, RuntimeError, ValueError) as e:
        raise ApiError(400, f"adapter path {path!r} cannot be resolved: {e}",
                       param="path") from None
    if any(real.is_relative_to(r) for r in roots):
        return real
    listed = ", ".join(str(r) for r in roots) or "none"
    raise ApiError(403, f"adapter path {path} resolves to {real}, outside this node's adapter "
                   f"roots ({listed}); put the adapter under one of them, or start the node "
                   "with --adapter-root DIR", "PermissionDeniedError", "path")
