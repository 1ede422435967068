"""A rollout node against resource and value attacks (issue 44, items 8 and 9):

- adapters that are finite but absurd (values of 1e30, a lora_alpha of 1e38) are
  refused with a 400 naming the tensor or field and the bound, and so is one within
  the bounds whose logits overflow on a probe input; the old adapter keeps serving;
- an idle or stalled connection is closed (a stalled body: 408), and connections
  beyond the node's bound are answered 503;
- a prompt that cannot fit the context is refused by its size in characters,
  before it is tokenized;
- a chat content part whose text is not a string is a 400, not a 500.

Here: the checks through in-process servers (the others:
tests/unit/test_adapter_bounds.py)."""

import http.client
import json
import socket
from pathlib import Path

import numpy as np
import pytest
from helpers.wait import wait_until

from yeto.interop.adapters import (
    MAX_FACTOR_ABS,
    MAX_LORA_SCALE,
    peft_adapter_config,
    peft_to_mlx,
    save_peft_adapter,
)
from yeto.rollout.engine import PROBE_TOKENS, stop_token_ids
from yeto.rollout.server import RolloutNode, serve_in_thread
from yeto.rollout.torch_engine import TorchEngine

PROMPT = [3, 569, 264, 203, 343, 30, 382]
JSON = {"Content-Type": "application/json"}
HANG_GUARD_S = 60  # only so that a server that never answers fails the test


@pytest.fixture(scope="module")
def node(tiny_llama, tmp_path_factory):
    """(node, base URL, adapter root) of a torch node whose connections time out
    after half a second of silence."""
    root = tmp_path_factory.mktemp("adapters")
    engine = TorchEngine(tiny_llama)
    node = RolloutNode(engine, model_name="tiny", adapter_roots=[root],
                       eos_ids=stop_token_ids(engine.model_dir, engine.tokenizer))
    server, url = serve_in_thread(node, timeout_s=0.5)
    yield node, url, root
    server.shutdown()
    server.server_close()
    node.close()


def _call(url: str, path: str, body) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=HANG_GUARD_S)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, JSON)
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def _refused(got: int, reply: dict, status: int, *words) -> None:
    assert got == status, reply
    for w in words:
        assert str(w).lower() in reply["error"]["message"].lower(), (w, reply)


# ---- adapters --------------------------------------------------------------------
def _save(out: Path, model_dir, tensors: dict, r: int = 16, alpha: float = 32.0) -> Path:
    modules = sorted({k[len("base_model.model."):-len(".lora_A.weight")] for k in tensors
                      if k.endswith(".lora_A.weight")})
    return save_peft_adapter(out, tensors, peft_adapter_config(str(model_dir), r, alpha,
                                                               modules))


def _sample(url: str) -> dict:
    got, reply = _call(url, "/v1/completions", dict(
        prompt=PROMPT, max_tokens=6, n=2, seed=5, temperature=1.0, logprobs=1,
        ignore_eos=True, return_tokens_as_token_ids=True))
    assert got == 200, reply
    return reply


def test_absurd_adapters_are_refused_and_the_old_one_keeps_serving(node, tiny_llama):
    n_, url, root = node
    layout = n_.engine.layout
    good = layout.unflatten(np.random.default_rng(3).normal(0, 0.05, layout.numel)
                            .astype(np.float32))
    got, reply = _call(url, "/reload_adapter", {"path": str(_save(root / "good", tiny_llama,
                                                                  good))})
    assert got == 200, reply
    version, before, weights = reply["yeto_version"], _sample(url), n_.engine.weights.get()
    name = sorted(good)[5]
    huge = dict(good, **{name: np.full_like(good[name], 1e30)})
    # within both bounds, yet layer 0's MLP overflows: only the probe can tell
    overflow = {k: np.full_like(v, MAX_FACTOR_ABS / 2 if "layers.0.mlp" in k else 0.0)
                for k, v in good.items()}
    peft_to_mlx(_save(root / "huge", tiny_llama, huge), root / "huge-mlx", base_model=tiny_llama)
    pattern = _save(root / "pattern", tiny_llama, good)  # served with one alpha: wrong there
    cfg = json.loads((pattern / "adapter_config.json").read_text())
    module = name.split(".lora_")[0].removeprefix("base_model.model.")
    (pattern / "adapter_config.json").write_text(json.dumps(dict(cfg, alpha_pattern={
        module: 64})))
    cases = [  # (adapter dir, words of the refusal)
        (pattern, ("alpha_pattern", module)),
        (_save(root / "huge", tiny_llama, huge), (name, "1e+30", f"{MAX_FACTOR_ABS:g}")),
        (root / "huge-mlx", (name, "1e+30", f"{MAX_FACTOR_ABS:g}")),
        (_save(root / "alpha", tiny_llama, good, alpha=1e38),
         ("lora_alpha", f"{MAX_LORA_SCALE:g}")),
        (_save(root / "overflow", tiny_llama, overflow, alpha=16 * MAX_LORA_SCALE / 1.6),
         ("NaN or infinite", f"{PROBE_TOKENS}-token probe")),
    ]
    for adapter, words in cases:
        got, reply = _call(url, "/reload_adapter", {"path": str(adapter)})
        _refused(got, reply, 400, *words, f"still serves version {version}")
    after = _sample(url)
    assert after["yeto_version"] == version and np.array_equal(n_.engine.weights.get(), weights)
    for a, b in zip(before["choices"], after["choices"], strict=True):
        assert a["logprobs"] == b["logprobs"]
        assert np.isfinite(a["logprobs"]["token_logprobs"]).all()


# ---- connections -----------------------------------------------------------------
def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=HANG_GUARD_S)
    return sock


def _read_to_eof(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_idle_and_stalled_connections_are_closed(node):
    _, url, _ = node
    with _connect(url) as idle:  # slowloris: connects, sends nothing
        assert _read_to_eof(idle) == b""
    with _connect(url) as partial:  # sends half a request line
        partial.sendall(b"POST /v1/completions HTT")
        assert _read_to_eof(partial) == b""
    with _connect(url) as stalled:  # promises 100 bytes of body, sends 10
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                        b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
        head, _, body = _read_to_eof(stalled).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), head
        assert "stalled" in json.loads(body)["error"]["message"]
    with _connect(url) as kept:  # keep-alive: served, then closed once idle
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _read_to_eof(kept).startswith(b"HTTP/1.1 200")


def test_connections_beyond_the_bound_are_answered_503(node):
    n_, _, _ = node
    server, url = serve_in_thread(n_, max_connections=2)
    try:
        held = [_connect(url), _connect(url)]
        with _connect(url) as third:
            head, _, body = _read_to_eof(third).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), head
        assert "2 connections open" in json.loads(body)["error"]["message"]
        held[0].sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert held[0].recv(65536).startswith(b"HTTP/1.1 200")  # the held ones are served
        for s in held:
            s.close()

        def served() -> bool:  # once a held connection's thread has ended, a slot is free
            with _connect(url) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                return _read_to_eof(s).startswith(b"HTTP/1.1 200")

        assert wait_until(served, timeout=HANG_GUARD_S)
    finally:
        server.shutdown()
        server.server_close()


# ---- prompts -----------------------------------------------------------------------
def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(node):
    n_, url, _ = node
    ctx = n_.ctx
    longest = max(map(len, n_.tokenizer.get_vocab()))
    assert ctx.max_chars == ctx.max_len * longest
    text = "x" * (ctx.max_chars + 1)
    for path, body, param in (
            ("/v1/completions", {"prompt": text}, "prompt"),
            ("/v1/completions", {"prompt": ["hello", text]}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]},
             "messages"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": text[:20]}] *
                                      (ctx.max_chars // 20)}, "messages")):
        got, reply = _call(url, path, body)
        _refused(got, reply, 400, f"{ctx.max_chars} characters", "context length")
        assert reply["error"]["param"] == param
    got, reply = _call(url, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 3})
    assert got == 200, reply


@pytest.mark.parametrize("part, words", [
    ({"type": "text", "text": 5}, "messages[0]: content[1].text must be a string"),
    ({"type": "image_url", "image_url": {"url": "http://x"}}, "content[1] is not a text part"),
    ("hi", "content[1] is not a text part"),
])
def test_a_chat_content_part_without_string_text_is_a_400(node, part, words):
    _, url, _ = node
    content = [{"type": "text", "text": "reverse: apple river"}, part]
    got, reply = _call(url, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": content}], "max_tokens": 3})
    _refused(got, reply, 400, words)
    assert reply["error"]["param"] == "messages"
    content[1] = {"type": "text", "text": " now"}
    got, reply = _call(url, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": content}], "max_tokens": 3})
    assert got == 200, reply
