"""A rollout node's trust boundary (issue 28): it answers no web page (Host, Origin,
Content-Type), bounds the rows of a request by --max-batch, refuses non-finite or
out-of-range sampling settings, refuses broken adapters while the old one keeps
serving, and loads adapters only from under its adapter roots. Every refusal is a
JSON error that says what to do, and the node keeps serving.

Here: the checks through in-process servers, training or the sim (the others:
tests/unit/test_rollout_trust.py)."""


import http.client
import json
import os
from pathlib import Path

import numpy as np
import pytest

from yeto.interop.adapters import PEFT_WEIGHTS, peft_adapter_config, save_peft_adapter
from yeto.rollout import api
from yeto.rollout.engine import stop_token_ids
from yeto.rollout.server import RolloutNode, serve_in_thread
from yeto.rollout.torch_engine import TorchEngine

PROMPT = [3, 569, 264, 203, 343, 30, 382]


MAX_BATCH = 4


@pytest.fixture(scope="module")
def node(tiny_llama, tmp_path_factory):
    """(node, base URL, adapter root) of a torch node with --max-batch 4."""
    root = tmp_path_factory.mktemp("adapters")
    engine = TorchEngine(tiny_llama)
    node = RolloutNode(engine, model_name="tiny", max_batch=MAX_BATCH, adapter_roots=[root],
                       eos_ids=stop_token_ids(engine.model_dir, engine.tokenizer))
    server, url = serve_in_thread(node)
    yield node, url, root
    server.shutdown()
    server.server_close()
    node.close()


def _call(url: str, method: str, path: str, body=None, headers=None, conn=None):
    """(status, JSON reply) of one request with exactly `headers` (plus Host unless
    given); `body` is sent as is when bytes, else as JSON."""
    netloc = url.removeprefix("http://")
    conn = conn or http.client.HTTPConnection(netloc, timeout=60)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, data, dict(headers or {}))
    r = conn.getresponse()
    return r.status, json.loads(r.read())


JSON = {"Content-Type": "application/json"}


GOOD = {"prompt": PROMPT, "max_tokens": 3}


def _refused(reply: dict, status: int, *words: str) -> None:
    err = reply["error"]
    assert err["code"] == status, reply
    for w in words:
        assert w.lower() in err["message"].lower(), (w, reply)


def test_web_pages_cannot_drive_the_node(node):
    """Cross-origin, DNS-rebound and text/plain (no CORS preflight) requests are
    refused; the node's own origins and JSON with a charset are served."""
    _, url, _ = node
    port = int(url.rsplit(":", 1)[1])
    refused = [
        ({"Content-Type": "text/plain"}, 415, "application/json"),
        ({}, 415, "Content-Type"),
        ({"Content-Type": "application/x-www-form-urlencoded"}, 415, "application/json"),
        (dict(JSON, Origin="http://evil.example"), 403, "cross-origin"),
        (dict(JSON, Origin="null"), 403, "cross-origin"),
        (dict(JSON, Origin=f"http://127.0.0.1:{port + 1}"), 403, "cross-origin"),
        (dict(JSON, Host=f"evil.example:{port}"), 403, "DNS-rebinding", "--allow-host"),
        (dict(JSON, Host="127.0.0.1@evil.example"), 403, "Host"),
    ]
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
    for headers, status, *words in refused:  # one keep-alive connection throughout
        got, reply = _call(url, "POST", "/v1/completions", GOOD, headers, conn=conn)
        assert got == status, (headers, reply)
        _refused(reply, status, *words)
    got, reply = _call(url, "GET", "/v1/models", headers={"Host": "attacker.test"})
    assert got == 403, reply
    served = [JSON, {"Content-Type": "Application/JSON; charset=utf-8"},
              dict(JSON, Origin=f"http://127.0.0.1:{port}"),
              dict(JSON, Origin=f"http://localhost:{port}", Host=f"localhost:{port}"),
              dict(JSON, Host="127.0.0.1")]
    for headers in served:
        got, reply = _call(url, "POST", "/v1/completions", GOOD, headers, conn=conn)
        assert got == 200 and reply["choices"], (headers, reply)


def test_rows_per_request_are_bounded_by_max_batch(node):
    n_, url, _ = node
    for path, body, rows in (("/v1/completions", dict(GOOD, prompt=[PROMPT] * 3, n=2), 6),
                             ("/v1/completions", dict(GOOD, n=5), 5),
                             ("/v1/chat/completions", {"messages": [
                                 {"role": "user", "content": "hi"}], "n": 9}, 9)):
        got, reply = _call(url, "POST", path, body, JSON)
        assert got == 400, reply
        _refused(reply, 400, f"{rows} rows", f"at most {MAX_BATCH}", "--max-batch")
    got, reply = _call(url, "POST", "/v1/completions", dict(GOOD, prompt=[PROMPT] * 2, n=2),
                       JSON)
    assert got == 200 and len(reply["choices"]) == 4
    assert n_.status()["max_batch"] == MAX_BATCH


@pytest.mark.parametrize("raw, words", [
    ('"temperature": NaN', "NaN"),
    ('"temperature": Infinity', "Infinity"),
    ('"top_p": -Infinity', "Infinity"),
    ('"temperature": 1e999', "1e999"),
    ('"temperature": 1' + "0" * 400, "finite"),
    ('"temperature": -0.5', "temperature"),
    ('"top_p": 0', "top_p"),
    ('"top_p": 1.5', "top_p"),
    ('"max_tokens": 0', "max_tokens"),
    ('"max_tokens": 1000000000', "context length"),
    ('"n": 0', "n must be"),
])
def test_sampling_settings_must_be_finite_and_in_range(node, raw, words):
    _, url, _ = node
    body = f'{{"prompt": {PROMPT}, "max_tokens": 3, {raw}}}'.encode()
    got, reply = _call(url, "POST", "/v1/completions", body, JSON)
    assert got == 400, reply
    _refused(reply, 400, words)


def test_api_refuses_non_finite_numbers_from_any_caller(node):
    n_, _, _ = node
    for key in ("temperature", "top_p"):
        for bad in (float("nan"), float("inf")):
            with pytest.raises(api.ApiError, match="finite"):
                api.parse_completion({"prompt": PROMPT, key: bad}, n_.ctx)


# ---- adapters ----------------------------------------------------------------------
def _tensors(engine, seed: int) -> dict[str, np.ndarray]:
    """LoRA weights of the node's own shape that change its outputs (B is not zero)."""
    flat = np.random.default_rng(seed).normal(0, 0.05, engine.layout.numel).astype(np.float32)
    return engine.layout.unflatten(flat)


def _save(out: Path, model_dir, tensors: dict, r: int = 16, alpha: float = 32.0) -> Path:
    modules = sorted({k[len("base_model.model."):-len(".lora_A.weight")] for k in tensors
                      if k.endswith((".lora_A.weight", ".lora_B.weight"))})
    return save_peft_adapter(out, tensors, peft_adapter_config(str(model_dir), r, alpha,
                                                               modules))


def _reload(url: str, path) -> tuple[int, dict]:
    return _call(url, "POST", "/reload_adapter", {"path": str(path)}, JSON)


def _sample(url: str) -> dict:
    got, reply = _call(url, "POST", "/v1/completions", dict(
        GOOD, max_tokens=8, n=2, seed=11, temperature=1.0, logprobs=1, ignore_eos=True,
        return_tokens_as_token_ids=True), JSON)
    assert got == 200, reply
    return reply


def _bad_adapters(engine, good: dict) -> list[tuple[str, dict, dict, str]]:
    """(name, tensors, config overrides, words of the refusal) of broken adapters."""
    names = sorted(good)
    a_name = next(n for n in names if n.endswith("lora_A.weight"))
    nan, inf = dict(good), dict(good)
    nan[a_name] = good[a_name].copy()
    nan[a_name][0, 0] = np.nan
    inf[names[-1]] = np.full_like(good[names[-1]], np.inf)
    wide = dict(good, **{a_name: np.zeros((16, good[a_name].shape[1] + 1), np.float32)})
    stray = dict(good, **{"base_model.model.model.layers.0.mlp.nowhere.lora_A.weight":
                          np.zeros((16, 8), np.float32),
                          "base_model.model.model.layers.0.mlp.nowhere.lora_B.weight":
                          np.zeros((8, 16), np.float32)})
    missing = {k: v for k, v in good.items() if k != a_name.replace("lora_A", "lora_B")}
    return [("nan", nan, {}, "non-finite"), ("inf", inf, {}, "non-finite"),
            ("rank0", good, {"r": 0}, "r must be"), ("rank8", good, {"r": 8}, "r=8"),
            ("alpha", good, {"alpha": float("nan")}, "lora_alpha"),
            ("missing", missing, {}, "no lora_B"), ("wide", wide, {}, "shape"),
            ("stray", stray, {}, "nowhere")]


def test_a_refused_adapter_leaves_the_old_one_serving(node, tiny_llama):
    n_, url, root = node
    good = _tensors(n_.engine, 21)
    got, reply = _reload(url, _save(root / "good", tiny_llama, good))
    assert got == 200, reply
    version, before = reply["yeto_version"], _sample(url)
    weights = n_.engine.weights.get()
    for name, tensors, cfg, words in _bad_adapters(n_.engine, good):
        got, reply = _reload(url, _save(root / name, tiny_llama, tensors, **cfg))
        assert got == 400, (name, reply)
        _refused(reply, 400, words, f"still serves version {version}")
    garbled = _save(root / "garbled", tiny_llama, good)
    (garbled / PEFT_WEIGHTS).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    got, reply = _reload(url, garbled)
    assert got == 400, reply
    _refused(reply, 400, "cannot load the adapter")
    after = _sample(url)
    assert after["yeto_version"] == version and np.array_equal(n_.engine.weights.get(), weights)
    for a, b in zip(before["choices"], after["choices"], strict=True):
        assert a["logprobs"] == b["logprobs"] and a["text"] == b["text"]


def test_adapters_load_only_from_under_the_adapter_roots(node, tiny_llama, tmp_path):
    n_, url, root = node
    good = _tensors(n_.engine, 22)
    outside = _save(tmp_path / "outside", tiny_llama, good)
    (root / "link").symlink_to(outside, target_is_directory=True)
    for path in (outside, root / "link", f"{root}/../{tmp_path.name}/outside",
                 Path(os.path.relpath(outside))):
        got, reply = _reload(url, path)
        assert got == 403, (path, reply)
        _refused(reply, 403, "outside this node's adapter roots", str(root), "--adapter-root")
    got, reply = _reload(url, root / "nope")
    assert got == 404, reply
    got, reply = _reload(url, _save(root / "inside", tiny_llama, good))
    assert got == 200, reply
