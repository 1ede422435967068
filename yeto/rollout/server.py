"""`python -m yeto.rollout`: a rollout node's HTTP server (standard library).

Routes (JSON in, JSON out; errors are ``{"error": {message, type, param, code}}``
with a 4xx status, and the node keeps serving):

    GET  /v1/models               the served model (vLLM's shape, max_model_len)
    POST /v1/completions          see `yeto.rollout.api`
    POST /v1/chat/completions
    POST /reload_adapter          {"path": DIR, "version"?: int}: a peft or mlx-lm
                                  adapter, converted as needed; also vLLM's
                                  /v1/load_lora_adapter {"lora_path": DIR}
    GET  /health                  200 while serving
    GET  /yeto/status             version, counters, the observer's state

With ``--api-key`` (or $YETO_ROLLOUT_API_KEY) every route but /health needs
``Authorization: Bearer KEY`` (401 otherwise). Every route refuses a Host that
does not name the node and a cross-origin ``Origin`` (403), every POST a body not
sent as ``application/json`` (415), and adapters load only from under the
node's adapter roots (403); see `yeto.rollout.guard`. JSON bodies must hold
finite numbers (no NaN / Infinity). A connection idle or stalled mid-request for
`CONNECTION_TIMEOUT_S` is closed (a body cut short: 408), and beyond
`MAX_CONNECTIONS` open at once a new one is answered 503 and closed.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import os
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from yeto.rollout import api
from yeto.rollout.adapters import AdapterError
from yeto.rollout.generate import make_rows
from yeto.rollout.guard import Guard, adapter_dir, resolve_roots
from yeto.rollout.scheduler import Scheduler

log = logging.getLogger("yeto.rollout")

API_KEY_ENV = "YETO_ROLLOUT_API_KEY"
MAX_BODY = 32 << 20
REQUEST_TIMEOUT_S = 3600.0
CONNECTION_TIMEOUT_S = 30.0  # the longest wait for a client's next bytes (idle or mid-request)
MAX_CONNECTIONS = 1024       # connections open at once (a thread each)


class RolloutNode:
    """An engine behind a scheduler, and what the HTTP layer needs around it."""

    def __init__(self, engine, *, model_name: str, eos_ids, max_batch: int = 64,
                 api_key: str | None = None, request_log: Path | None = None,
                 aliases: tuple[str, ...] = (), adapter_roots=None):
        """`adapter_roots`: the directories `/reload_adapter` may load from (default:
        the current working directory)."""
        self.engine, self.tokenizer = engine, engine.tokenizer
        self._tok_lock = threading.Lock()  # HF tokenizers: one caller at a time
        self.scheduler = Scheduler(engine, eos_ids, self.detok, max_batch=max_batch)
        self.ctx = api.Context(model_name, _Locked(self.tokenizer, self._tok_lock),
                               engine.max_len, engine.vocab_size, aliases,
                               max_rows=self.scheduler.max_batch,
                               max_chars=api.max_prompt_chars(self.tokenizer, engine.max_len))
        self.adapter_roots = resolve_roots([Path.cwd()] if adapter_roots is None
                                           else adapter_roots)
        self.api_key, self.request_log = api_key, request_log
        self.follower = None  # the observer of a run (yeto.rollout.observer.Follower)
        self.base_aliases = tuple(aliases)
        self._log_lock = threading.Lock()
        self.started = time.time()

    def detok(self, ids: list[int]) -> str:
        with self._tok_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def complete(self, body: dict, chat: bool, path: str) -> dict:
        req = (api.parse_chat if chat else api.parse_completion)(body, self.ctx)
        rows = [r for i, p in enumerate(req.prompts) for r in make_rows(p, req.params, req.n, i)]
        served = self.scheduler.submit(rows).result(timeout=REQUEST_TIMEOUT_S)
        self._log(path, req, served.version)
        return api.response(req, served.outputs, served.version, self.ctx)

    def reload(self, body: dict) -> dict:
        path = body.get("path") or body.get("lora_path") or body.get("adapter_path")
        if not isinstance(path, str) or not path:
            raise api.ApiError(400, "send {\"path\": \"/dir/of/adapter\"} (a peft or mlx-lm "
                               "adapter directory)", param="path")
        real = adapter_dir(path, self.adapter_roots)
        if not real.is_dir():
            raise api.ApiError(404, f"adapter directory {path} not found on the node",
                               "NotFoundError", "path")
        version = api.int_field(body, "version", None)
        name = body.get("lora_name")
        if name is not None and not (isinstance(name, str) and 0 < len(name) <= 200
                                     and name.isprintable()):
            raise api.ApiError(400, "lora_name must be a short printable name",
                               param="lora_name")
        fixed = self.follower is not None

        def load():
            kind = self.engine.load_adapter(real, fixed_layout=fixed)
            s = self.scheduler
            s.version = version if version is not None else s.version + 1
            return kind, s.version

        try:
            kind, v = self.scheduler.call(load).result(timeout=REQUEST_TIMEOUT_S)
        except AdapterError as e:
            raise api.ApiError(400, f"{e}; the node still serves version "
                               f"{self.scheduler.version}", param="path") from e
        if name is not None:  # vLLM's way: requests then ask for the adapter by this name
            self.ctx.aliases = (*self.base_aliases, name)
        log.info("adapter %s (%s) loaded as version %d%s", real, kind, v,
                 f" ({name})" if name else "")
        return {"status": "ok", "format": kind, "yeto_version": v}

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.ctx.model_name, "object": "model", "created": int(self.started),
            "owned_by": "yeto", "root": str(self.engine.model_dir),
            "max_model_len": self.ctx.max_len, "backend": self.engine.name}]}

    def status(self) -> dict:
        s = self.scheduler
        return dict(model=self.ctx.model_name, backend=self.engine.name, version=s.version,
                    max_batch=s.max_batch, requests=s.requests, rows=s.rows_served,
                    tokens_out=s.tokens_out, batches=s.batches, busy_s=round(s.busy_s, 3),
                    uptime_s=round(time.time() - self.started, 1),
                    observer=self.follower.status() if self.follower else None)

    def _log(self, path: str, req: api.Request, version: int) -> None:
        if self.request_log is None:
            return
        line = json.dumps(dict(time=time.time(), path=path, prompts=req.prompts, n=req.n,
                               version=version))
        with self._log_lock, open(self.request_log, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def close(self) -> None:
        if self.follower is not None:
            self.follower.close()
        self.scheduler.close()


class _Locked:
    """A tokenizer whose calls hold a lock (HF fast tokenizers are not re-entrant)."""

    def __init__(self, tok, lock: threading.Lock):
        self._tok, self._lock = tok, lock

    def __call__(self, *a, **kw):
        with self._lock:
            return self._tok(*a, **kw)

    def decode(self, *a, **kw):
        with self._lock:
            return self._tok.decode(*a, **kw)

    def apply_chat_template(self, *a, **kw):
        with self._lock:
            return self._tok.apply_chat_template(*a, **kw)


def _not_json(name: str):
    """json's hook for NaN / Infinity / -Infinity, which JSON does not have."""
    raise ValueError(f"{name} is not a JSON number: send finite numbers")


def _finite_float(text: str) -> float:
    """json's hook for numbers with a fraction or exponent: 1e999 is not a float."""
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"{text} overflows a float: send finite numbers")
    return x


class Handler(BaseHTTPRequestHandler):
    server_version = "yeto-rollout"
    protocol_version = "HTTP/1.1"
    node: RolloutNode  # set on the class made by `make_server`
    guard: Guard       # likewise: the Host / Origin / Content-Type rules

    def log_message(self, fmt: str, *args) -> None:
        log.debug("%s %s", self.address_string(), fmt % args)

    def do_GET(self) -> None:
        self._route({"/v1/models": lambda _: self.node.models(),
                     "/yeto/status": lambda _: self.node.status(),
                     "/health": lambda _: {"status": "ok"},
                     "/version": lambda _: {"version": "yeto"}}, body=False)

    def do_POST(self) -> None:
        n = self.node
        self._route({"/v1/completions": lambda b: n.complete(b, False, self.path),
                     "/v1/chat/completions": lambda b: n.complete(b, True, self.path),
                     "/reload_adapter": n.reload, "/v1/load_lora_adapter": n.reload},
                    body=True)

    def _route(self, routes: dict, body: bool) -> None:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        self._read = False  # whether this request's body has been read
        try:
            self.guard.check(self.headers, post=body)
            if path not in routes:
                raise api.ApiError(404, f"no route {self.command} {path}; see GET /v1/models, "
                                   "POST /v1/completions, /v1/chat/completions, "
                                   "/reload_adapter", "NotFoundError")
            self._check_key(path)
            payload = self._body() if body else None
            self._send(200, routes[path](payload))
        except api.ApiError as e:
            self._discard()
            self._send(e.status, e.body())
        except Exception as e:  # noqa: BLE001 - the node keeps serving
            log.exception("%s %s failed", self.command, path)
            self._discard()
            self._send(500, api.ApiError(500, f"internal error: {e}", "InternalServerError")
                       .body())

    def _check_key(self, path: str) -> None:
        key = self.node.api_key
        if not key or path == "/health":
            return
        given = self.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise api.ApiError(401, "missing or wrong API key: send the header "
                               "'Authorization: Bearer <key>' (the node's --api-key)",
                               "AuthenticationError")

    def _length(self) -> int:
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = -1
        if n < 0:
            self.close_connection = True
            raise api.ApiError(400, "bad Content-Length header")
        return n

    def _discard(self) -> None:
        """Read past an unread body (keep-alive stays in step), or close the connection."""
        if self._read:
            return
        self._read = True
        try:
            n = self._length()
        except api.ApiError:
            return
        if n > MAX_BODY:
            self.close_connection = True
        elif n:
            try:
                self.rfile.read(n)
            except TimeoutError:
                self.close_connection = True

    def _body(self) -> dict:
        n = self._length()
        if n > MAX_BODY:
            self.close_connection = True
            raise api.ApiError(413, f"request body over {MAX_BODY} bytes", "RequestTooLarge")
        self._read = True
        try:
            raw = self.rfile.read(n) if n else b""
        except TimeoutError:
            self.close_connection = True  # the stream is out of step: no keep-alive
            raise api.ApiError(408, f"the request body stalled: no byte of it came for "
                               f"{self.timeout:g} s (Content-Length {n}); send the whole body "
                               "at once", "RequestTimeoutError") from None
        try:
            body = json.loads(raw or b"null", parse_constant=_not_json,
                              parse_float=_finite_float)
        except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
            raise api.ApiError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise api.ApiError(400, "the request body must be a JSON object")
        return body

    def _send(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode("utf-8")
        self.send_response(status, HTTPStatus(status).phrase)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    """A thread per connection, at most `max_connections` at once: one more is
    answered 503 and closed, so held-open connections cannot pile up threads."""

    daemon_threads = True

    def __init__(self, address, handler, max_connections: int):
        super().__init__(address, handler)
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)  # starts the thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request) -> None:
        body = json.dumps(api.ApiError(
            503, f"the node has {self.max_connections} connections open, its limit: close "
            "idle connections, or retry", "ServiceUnavailableError").body()).encode()
        head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        try:
            request.setblocking(False)  # a short reply into an empty buffer: never waits
            request.sendall(head + body)
        except OSError:
            pass
        self.shutdown_request(request)


def make_server(node: RolloutNode, host: str = "127.0.0.1", port: int = 0,
                allow_hosts: tuple[str, ...] = (), timeout_s: float = CONNECTION_TIMEOUT_S,
                max_connections: int = MAX_CONNECTIONS) -> ThreadingHTTPServer:
    """An HTTP server for `node` (port 0: any free port; see `server_address`).
    `allow_hosts`: Host names it answers to besides its own (``*``: any);
    `timeout_s`: how long a connection may wait for the client's next bytes before
    it is closed; `max_connections`: how many may be open at once."""
    handler = type("NodeHandler", (Handler,), {"node": node, "timeout": timeout_s})
    server = _Server((host, port), handler, max_connections)
    handler.guard = Guard.for_bind(host, server.server_address[1], allow_hosts)
    return server


def serve_in_thread(node: RolloutNode, host: str = "127.0.0.1", port: int = 0, **kw):
    """Start serving on a daemon thread; returns (server, base URL). Stop with
    `server.shutdown(); server.server_close()`. `kw`: `make_server`'s."""
    server = make_server(node, host, port, **kw)
    threading.Thread(target=server.serve_forever, daemon=True, name="yeto-http").start()
    h, p = server.server_address[:2]
    return server, f"http://{h}:{p}"


def api_key_from_env(key: str | None) -> str | None:
    return key or os.environ.get(API_KEY_ENV) or None
