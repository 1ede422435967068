"""The syncer's live dashboard: one HTML page and a small JSON API over HTTP.

Started by ``python -m syncer --dashboard-port PORT`` (loopback by default), it
serves, read-only:

  /              the page: islands table, held-out and training loss per island
                 over rounds, tokens per island, merge weights (shares), bytes on
                 the wire, round timings, rejected messages. It polls the API
                 every 2 s; everything (CSS, JS, SVG charts) is inline, so it
                 works with no internet access.
  /api/status    the run: `Run.status()` plus its config and counters; with
                 ``--dashboard-shards`` (a sharded run) each shard's status too
                 and every island over all of them
  /api/tape      the tape's records (``?since=N`` skips the first N)
  /healthz       "ok"

Beyond loopback the syncer's token is required (``Authorization: Bearer TOKEN``
header, or ``?token=TOKEN`` in the page's address, which the page then sends
with its API calls); without a token it refuses to listen there unless told
``insecure=True``. Plain HTTP: the token crosses the network in clear, so beyond
loopback prefer an SSH tunnel (``ssh -L 8080:127.0.0.1:8080 host``).

Standard library only: `http.server.ThreadingHTTPServer` in a daemon thread.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Sequence
from email.message import Message
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

import grpc

from yeto.client.connection import TLSConfig, merged_islands, status
from yeto.io import JsonlFollower, finite_or_none, host_port
from yeto.net import is_loopback
from yeto.signals import GracefulStop

if TYPE_CHECKING:
    from syncer.run import Run

LOOPBACK_NAMES = {"127.0.0.1", "localhost", "::1"}  # what a loopback dashboard answers to

log = logging.getLogger("syncer.dashboard")

MAX_RECORDS_PER_REPLY = 5000


class DashboardError(RuntimeError):
    """The dashboard cannot start as asked."""


class TapeCache:
    """The tape's records, read incrementally from its file."""

    def __init__(self, path: Path | None):
        self.path = path
        self._follower = JsonlFollower(path) if path is not None else None
        self._records: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def since(self, n: int) -> tuple[list[dict[str, Any]], int]:
        with self._lock:
            if self._follower is not None:
                self._records.extend(self._follower.read_new())
            n = max(0, min(n, len(self._records)))
            out = self._records[n:n + MAX_RECORDS_PER_REPLY]
            return out, n + len(out)


class ShardView:
    """A sharded run as one dashboard shows it: every shard's Status (`yeto.client.status`,
    with the run's token), fetched at most once a second; a shard that does not answer
    is a row saying so."""

    EVERY_S = 1.0
    TIMEOUT_S = 2.0

    def __init__(self, addresses: list[str], token: str | None, tls: TLSConfig | None,
                 own: tuple[int, Callable[[], dict[str, Any]]] | None = None):
        """`own`: this syncer's position in `addresses` and its `Run.status`: that row
        is answered in-process (its address may be "self")."""
        self.addresses, self.token, self.tls, self.own = addresses, token, tls, own
        self._lock = threading.Lock()
        self._at, self._rows = -math.inf, []  # type: tuple[float, list[dict[str, Any]]]

    def rows(self) -> list[dict[str, Any]]:
        with self._lock:
            if time.monotonic() - self._at >= self.EVERY_S:
                self._rows = [self._fetch(pos, a) for pos, a in enumerate(self.addresses)]
                self._at = time.monotonic()
            return self._rows

    def _fetch(self, pos: int, address: str) -> dict[str, Any]:
        if self.own is not None and self.own[0] == pos:
            return dict(self.own[1](), position=pos,
                        address="this syncer" if address == "self" else address)
        try:
            got = status(address, self.token, self.tls, timeout=self.TIMEOUT_S)
        except grpc.RpcError as e:
            return dict(position=pos, address=address, islands=[],
                        error=f"{e.code().name}: {e.details()}")
        return dict(got, position=pos, address=address)


class Dashboard:
    """What the HTTP handler serves: built from a live `Run` (or only a tape file,
    for looking at a finished run); `shards`: every shard of a sharded run."""

    def __init__(self, run: Run | None = None, tape_path: Path | None = None,
                 token: str | None = None, require_token: bool = False,
                 loopback_only: bool = False, shards: ShardView | None = None):
        if tape_path is None and run is not None and getattr(run, "tape", None) is not None:
            tape_path = run.tape.path
        self.run = run
        self.tape = TapeCache(Path(tape_path) if tape_path else None)
        self.token = token
        self.require_token = require_token
        self.loopback_only = loopback_only  # listening on loopback: check the Host header
        self.shards = shards

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(time=time.time(),
                                   tape=str(self.tape.path) if self.tape.path else None,
                                   live=self.run is not None)
        if self.run is None:
            return out
        out.update(self.run.overview())
        if self.shards is not None:
            out["shard_rows"] = rows = self.shards.rows()
            out["run_islands"] = merged_islands(rows)
        return out

    def host_ok(self, host_header: str | None) -> bool:
        """On loopback, only requests addressed to a loopback name: a page on another
        site whose name was rebound to 127.0.0.1 (DNS rebinding) sends its own name."""
        if not self.loopback_only:
            return True
        host = (host_header or "").strip().lower()
        host = host[1:host.index("]")] if host.startswith("[") and "]" in host else \
            host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        return host in LOOPBACK_NAMES

    def authorized(self, headers: Message, query: dict[str, list[str]]) -> bool:
        if not self.require_token:
            return True
        if not self.token:
            return False
        got = headers.get("Authorization", "")
        if got.startswith("Bearer "):
            got = got[len("Bearer "):]
        else:
            got = (query.get("token") or [""])[0]
        return hmac.compare_digest(got.encode(), self.token.encode())


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 dashboard: Dashboard, family: socket.AddressFamily):
        self.address_family = family
        self.dashboard = dashboard
        super().__init__(address, handler)


class _Handler(BaseHTTPRequestHandler):
    server_version = "yeto-dashboard"
    sys_version = ""
    server: _Server  # (a declaration: the server that made the handler)

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet: standard logging at debug level
        log.debug("%s %s", self.address_string(), fmt % args)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        dash: Dashboard = self.server.dashboard
        if not dash.host_ok(self.headers.get("Host")):
            return self._send(HTTPStatus.MISDIRECTED_REQUEST,
                              b"this dashboard answers only requests to 127.0.0.1 or "
                              b"localhost\n", "text/plain; charset=utf-8")
        if url.path == "/healthz":
            return self._send(HTTPStatus.OK, b"ok\n", "text/plain; charset=utf-8")
        if not dash.authorized(self.headers, query):
            return self._send(HTTPStatus.UNAUTHORIZED,
                              b"missing or wrong token: open the page as "
                              b"http://HOST:PORT/?token=TOKEN (the syncer's token)\n",
                              "text/plain; charset=utf-8")
        try:
            if url.path in ("/", "/index.html"):
                return self._send(HTTPStatus.OK, page(), "text/html; charset=utf-8")
            if url.path == "/api/status":
                return self._json(dash.status())
            if url.path == "/api/tape":
                try:
                    since = int((query.get("since") or ["0"])[0])
                except ValueError:
                    return self._json({"error": "since must be an integer"},
                                      HTTPStatus.BAD_REQUEST)
                records, nxt = dash.tape.since(since)
                return self._json({"records": records, "next": nxt})
        except (BrokenPipeError, ConnectionResetError):
            return None
        except Exception as e:  # noqa: BLE001 - a broken request must not kill the server
            log.exception("dashboard request %s failed", url.path)
            return self._json({"error": f"{type(e).__name__}: {e}"},
                              HTTPStatus.INTERNAL_SERVER_ERROR)
        return self._send(HTTPStatus.NOT_FOUND, b"not found: try / or /api/status or /api/tape\n",
                          "text/plain; charset=utf-8")

    def _json(self, obj: object, status: HTTPStatus = HTTPStatus.OK) -> None:
        body = json.dumps(obj, default=_plain, allow_nan=False).encode()
        self._send(status, body, "application/json")

    def _send(self, status: HTTPStatus, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Content-Security-Policy",
                         "default-src 'none'; script-src 'unsafe-inline'; "
                         "style-src 'unsafe-inline'; connect-src 'self'; img-src data:")
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass


def _plain(x: object) -> float | str | None:
    """JSON for what json cannot encode itself: numbers (NaN/inf -> null), else text."""
    return finite_or_none(float(x)) if hasattr(x, "__float__") else str(x)


class DashboardServer:
    """A running dashboard; `url` is where to open it, `stop()` ends it."""

    def __init__(self, httpd: _Server, thread: threading.Thread, host: str, port: int):
        self.httpd, self.thread, self.host, self.port = httpd, thread, host, port

    @property
    def url(self) -> str:
        return f"http://{host_port(self.host, self.port)}/"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def start_dashboard(run: Run | None = None, host: str = "127.0.0.1", port: int = 0, *,
                    token: str | None = None, insecure: bool = False,
                    tape_path: Path | None = None,
                    shards: ShardView | None = None) -> DashboardServer:
    """Serve the dashboard of ``run`` (a `syncer.run.Run`) on host:port (0 = any free
    port) from a daemon thread. Beyond loopback ``token`` is required on every
    request; without one this refuses to start unless ``insecure``. ``shards``: the
    run's shards, shown together."""
    loopback = is_loopback(host)
    if not loopback and not token and not insecure:
        raise DashboardError(
            f"refusing to serve the dashboard on {host} without a token: anyone who can reach "
            "the port could watch the run. Set the syncer's --token (or $YETO_TOKEN), keep "
            "--dashboard-host 127.0.0.1 and use an SSH tunnel, or pass --insecure")
    # the token whenever the run has one, loopback too (any local page could read it)
    dash = Dashboard(run, tape_path=tape_path, token=token, require_token=bool(token),
                     loopback_only=loopback, shards=shards)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        httpd = _Server((host, port), _Handler, dash, family)
    except OSError as e:
        raise DashboardError(f"cannot serve the dashboard on {host_port(host, port)}: {e} (is "
                             "the port in use? --dashboard-port 0 picks a free one)") from None
    bound = httpd.server_address[1]
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2},
                              name="syncer-dashboard", daemon=True)
    thread.start()
    return DashboardServer(httpd, thread, host, bound)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m syncer.dashboard --tape runs/demo/syncer/tape.jsonl`: the dashboard of
    a finished (or another process's) run, from its tape alone."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m syncer.dashboard",
                                description="Serve the dashboard for a tape file (the charts "
                                            "and rejected messages; no live island table).")
    p.add_argument("--tape", type=Path, required=True, help="a syncer's tape.jsonl")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    args = p.parse_args(argv)
    if not args.tape.is_file():
        p.error(f"{args.tape} not found: pass a syncer's <state-dir>/tape.jsonl")
    server = start_dashboard(None, args.host, args.port, tape_path=args.tape,
                             token=None, insecure=False)
    print(f"dashboard on {server.url} (Ctrl-C ends)", flush=True)
    with GracefulStop() as stop:
        try:
            while not stop.event.wait(1.0):
                pass
        finally:
            server.stop()
    return 0


PAGE_FILE = Path(__file__).with_name("dashboard.html")


def page() -> bytes:
    """The page (read once; `syncer/dashboard.html`, inline CSS/JS, no external assets)."""
    global _PAGE
    if _PAGE is None:
        _PAGE = PAGE_FILE.read_bytes()
    return _PAGE


_PAGE: bytes | None = None


if __name__ == "__main__":
    import sys

    logging.basicConfig(level="INFO")
    sys.exit(main())
