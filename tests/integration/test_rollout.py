"""Rollout nodes (`python -m yeto.rollout`): logprobs equal the trainer's recomputation
(torch and MLX), an observer node serves every merged Θ, adapters load in either
format on either backend, one weights version per request, batched = alone, and
bad requests get a 4xx while the node keeps serving.

Here: the checks through in-process servers, training or the sim (the others:
tests/unit/test_rollout.py)."""


import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
from helpers.syncer import make_client, running_syncer
from helpers.wait import wait_until

from yeto import codec
from yeto.interop.adapters import peft_adapter_config, peft_to_mlx, save_peft_adapter
from yeto.rl.grpo import Seq, completion_logprobs
from yeto.rollout.adapters import LoraSpec
from yeto.rollout.engine import stop_token_ids
from yeto.rollout.server import RolloutNode, serve_in_thread
from yeto.rollout.torch_engine import TorchEngine
from yeto.transport import Refused

PROMPTS = [[3, 569, 264, 203, 343, 30, 382, 400, 403], [3, 569, 264, 203, 343, 30, 382]]


def _flat(layout, seed: int) -> np.ndarray:
    """LoRA weights that change the model's outputs (B is not zero)."""
    return np.random.default_rng(seed).normal(0, 0.05, layout.numel).astype(np.float32)


def _node(engine, **kw):
    node = RolloutNode(engine, model_name="tiny", eos_ids=stop_token_ids(engine.model_dir,
                                                                         engine.tokenizer), **kw)
    server, url = serve_in_thread(node)
    return node, server, url


def _close(node, server):
    server.shutdown()
    server.server_close()
    node.close()


def _post(url: str, body, key: str | None = None, raw: bytes | None = None):
    """(status, JSON reply) of a POST, 4xx included."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class Trainer:
    """The GRPO island's recomputation: its own torch model, the LoRA the islands
    attach, `yeto.rl.grpo.completion_logprobs`."""

    def __init__(self, model_dir, spec=LoraSpec()):
        self.engine = TorchEngine(model_dir, spec)  # a torch model with peft LoRA
        self.model_dir = model_dir

    def logprobs(self, flat, prompt, tokens) -> np.ndarray:
        self.engine.set_weights(flat)
        with torch.no_grad():
            lp, _ = completion_logprobs(self.engine.model, [Seq(tuple(prompt), tokens, [], 0, 0)])
        return lp[0, :len(tokens)].numpy()


def _choices_vs_trainer(reply, prompts, n, trainer, flat) -> float:
    worst = 0.0
    for c in reply["choices"]:
        ids = [int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]]
        got = np.array(c["logprobs"]["token_logprobs"])
        want = trainer.logprobs(flat, prompts[c["index"] // n], ids)
        worst = max(worst, float(np.abs(got - want).max()))
    return worst


@pytest.fixture(scope="module")
def trainer(tiny_llama):
    return Trainer(tiny_llama)


@pytest.fixture(scope="module")
def torch_node(tiny_llama):
    node, server, url = _node(TorchEngine(tiny_llama))
    yield node, url
    _close(node, server)


def _sample(url, n=3, **kw):
    body = dict(prompt=PROMPTS, n=n, max_tokens=12, temperature=1.0, seed=7, logprobs=0,
                return_tokens_as_token_ids=True, **kw)
    status, reply = _post(f"{url}/v1/completions", body)
    assert status == 200, reply
    return reply


def test_torch_node_logprobs_equal_the_trainers(torch_node, trainer):
    node, url = torch_node
    flat = _flat(node.engine.layout, 1)
    node.scheduler.offer(flat, 7)
    assert wait_until(lambda: node.scheduler.version == 7)
    reply = _sample(url)
    assert reply["yeto_version"] == 7 and len(reply["choices"]) == 2 * 3
    assert _choices_vs_trainer(reply, PROMPTS, 3, trainer, flat) <= 1e-4


@pytest.mark.mlx
def test_mlx_node_logprobs_equal_the_trainers(tiny_llama, trainer):
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed")
    from yeto.rollout.mlx_engine import MLXEngine

    node, server, url = _node(MLXEngine(tiny_llama))
    try:
        flat = _flat(node.engine.layout, 2)
        node.scheduler.offer(flat, 3)
        assert wait_until(lambda: node.scheduler.version == 3)
        reply = _sample(url)
        assert reply["yeto_version"] == 3
        assert _choices_vs_trainer(reply, PROMPTS, 3, trainer, flat) <= 1e-3
    finally:
        _close(node, server)


def test_batched_requests_sample_what_they_sample_alone(torch_node):
    node, url = torch_node
    alone = _sample(url, n=2)
    out = {}

    def ask(i):
        out[i] = _sample(url, n=2) if i == 0 else _sample(url, n=5, top_p=0.9)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(alone["choices"], out[0]["choices"]):
        assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        assert np.allclose(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"],
                           atol=1e-5)


def test_a_request_is_served_by_one_weights_version(tiny_llama, trainer):
    """New weights offered while a batch decodes wait for the batch to end."""
    engine = TorchEngine(tiny_llama)
    old, new = _flat(engine.layout, 3), _flat(engine.layout, 4)
    engine.set_weights(old)
    node, server, url = _node(engine)
    decode, calls = engine.decode, []

    def offering_decode(state, tokens):  # mid-generation, the syncer sends a new Θ
        calls.append(1)
        if len(calls) == 2:
            node.scheduler.offer(new, 5)
        return decode(state, tokens)

    engine.decode = offering_decode
    try:
        first = _sample(url, ignore_eos=True)
        assert len(calls) > 2 and first["yeto_version"] == 0
        assert _choices_vs_trainer(first, PROMPTS, 3, trainer, old) <= 1e-4
        second = _sample(url)
        assert second["yeto_version"] == 5
        assert _choices_vs_trainer(second, PROMPTS, 3, trainer, new) <= 1e-4
    finally:
        _close(node, server)


def test_observer_node_serves_every_merged_version(tiny_llama, trainer):
    from yeto.rollout.observer import Follower, ObserverClient

    engine = TorchEngine(tiny_llama)
    node, server, url = _node(engine)
    layout = engine.layout
    with running_syncer(quorum=1) as (run, address):
        client = ObserverClient(address, "rollout-0", layout, backend="torch", backoff_s=0.05,
                                max_backoff_s=0.2)
        node.scheduler.version = -1
        node.follower = Follower(client, layout, node.scheduler)
        node.follower.start(engine.weights.get())
        assert wait_until(client.connected.is_set)
        assert not run.started  # an observer never counts toward the quorum
        [row] = run.status()["islands"]
        assert row["state"] == "observer" and row["learner_id"] == "rollout-0"
        island = make_client(address, "island-0", layout)
        theta0 = _flat(layout, 5)
        island.start(theta0)  # the island seeds Θ, never the observer
        assert island.wait(20) and wait_until(lambda: node.scheduler.version == 0)
        assert np.array_equal(run.theta, theta0)
        delta = _flat(layout, 6) * 0.2
        reply = island.push(codec.encode(delta, "f32"), encoding="f32", base_version=0,
                            loss_tokens=10, steps=1, seq=0).result(20)
        assert reply.accepted
        assert wait_until(lambda: node.scheduler.version == 1)
        merged = run.theta.copy()
        got = _sample(url)
        assert got["yeto_version"] == 1
        assert _choices_vs_trainer(got, PROMPTS, 3, trainer, merged) <= 1e-4
        with pytest.raises(Refused):
            client.push(b"", encoding="f32", base_version=1, loss_tokens=0, steps=0, seq=0)
        sneaky = make_client(address, "rollout-1", layout)  # observer that tries to push
        sneaky.connection.join_request.observer = True
        sneaky.start(theta0)
        assert wait_until(sneaky.connected.is_set)
        with pytest.raises(Refused, match="observer"):
            sneaky.push(codec.encode(delta, "f32"), encoding="f32", base_version=1,
                        loss_tokens=5, steps=1, seq=0).result(20)
        sneaky.close()
        island.close()
        node.follower.close()
    _close(node, server)


def _save_adapter(model_dir, tensors, spec: LoraSpec, out):
    modules = sorted({k[len("base_model.model."):-len(".lora_A.weight")]
                      for k in tensors if k.endswith(".lora_A.weight")})
    return save_peft_adapter(out, tensors, peft_adapter_config(str(model_dir), spec.r,
                                                               spec.alpha, modules))


@pytest.mark.mlx
def test_adapters_load_in_either_format_on_either_backend(tiny_llama, tmp_path, trainer):
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed")
    from yeto.rollout.mlx_engine import MLXEngine

    spec = LoraSpec(r=4, alpha=8.0)  # not the nodes' default shape: they rebuild their LoRA
    shaped = Trainer(tiny_llama, spec)
    flat = _flat(shaped.engine.layout, 8)
    peft_dir = _save_adapter(tiny_llama, shaped.engine.layout.unflatten(flat), spec,
                             tmp_path / "peft")
    mlx_dir = peft_to_mlx(peft_dir, tmp_path / "mlx", base_model=tiny_llama)
    for engine, adapter, tol in ((MLXEngine(tiny_llama), peft_dir, 1e-3),
                                 (TorchEngine(tiny_llama), mlx_dir, 1e-4)):
        node, server, url = _node(engine, adapter_roots=[tmp_path])
        try:
            status, reply = _post(f"{url}/reload_adapter", {"path": str(adapter)})
            assert status == 200 and reply["yeto_version"] == 1, reply
            assert reply["format"] == ("peft" if adapter == peft_dir else "mlx")
            got = _sample(url)
            assert got["yeto_version"] == 1
            assert _choices_vs_trainer(got, PROMPTS, 3, shaped, flat) <= tol
            status, reply = _post(f"{url}/v1/load_lora_adapter",
                                  {"lora_path": str(peft_dir), "version": 9})
            assert status == 200 and reply["yeto_version"] == 9
        finally:
            _close(node, server)


def test_bad_requests_get_4xx_and_the_node_keeps_serving(tiny_llama, tmp_path):
    node, server, url = _node(TorchEngine(tiny_llama), api_key="sesame", adapter_roots=[tmp_path])
    good = {"prompt": PROMPTS[0], "max_tokens": 4}
    cases = [  # (path, body, raw bytes, key, status, words in the message)
        ("/v1/completions", good, None, None, 401, "API key"),
        ("/v1/completions", good, None, "wrong", 401, "API key"),
        ("/v1/completions", dict(good, model="gpt-9"), None, "sesame", 404, "gpt-9"),
        ("/v1/completions", dict(good, max_tokens=-3), None, "sesame", 400, "max_tokens"),
        ("/v1/completions", dict(good, max_tokens=5000), None, "sesame", 400, "context length"),
        ("/v1/completions", dict(good, prompt=list(range(1020)), max_tokens=10), None,
         "sesame", 400, "context length"),
        ("/v1/completions", None, b'{"prompt": [1, 2', "sesame", 400, "JSON"),
        ("/v1/completions", {"max_tokens": 3}, None, "sesame", 400, "prompt"),
        ("/v1/completions", dict(good, prompt=[1, 10**9]), None, "sesame", 400, "token ids"),
        ("/v1/completions", dict(good, stream=True), None, "sesame", 400, "stream"),
        ("/v1/completions", dict(good, temperature="hot"), None, "sesame", 400, "temperature"),
        ("/v1/completions", dict(good, logprobs=99), None, "sesame", 400, "logprobs"),
        ("/v1/chat/completions", {"messages": "hi"}, None, "sesame", 400, "messages"),
        ("/reload_adapter", {"path": str(tmp_path)}, None, "sesame", 400, "adapter"),
        ("/reload_adapter", {"path": str(tmp_path / "nope")}, None, "sesame", 404, "not found"),
        ("/v1/nothing", {}, None, "sesame", 404, "no route"),
    ]
    try:
        for path, body, raw, key, status, words in cases:
            got, reply = _post(url + path, body, key=key, raw=raw)
            assert got == status, (path, body, reply)
            assert words.lower() in reply["error"]["message"].lower(), reply
            assert reply["error"]["code"] == status
        status, reply = _post(f"{url}/v1/completions", good, key="sesame")
        assert status == 200 and reply["choices"][0]["finish_reason"] in ("stop", "length")
        status, reply = _post(f"{url}/v1/chat/completions", {
            "messages": [{"role": "user", "content": "reverse: apple river"}],
            "logprobs": True, "top_logprobs": 2, "max_tokens": 6}, key="sesame")
        assert status == 200
        content = reply["choices"][0]["logprobs"]["content"]
        assert content and len(content[0]["top_logprobs"]) == 2
        assert reply["choices"][0]["message"]["role"] == "assistant"
    finally:
        _close(node, server)


def test_models_and_status_routes(torch_node):
    node, url = torch_node
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        models = json.loads(r.read())
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 1024
    with urllib.request.urlopen(f"{url}/yeto/status", timeout=10) as r:
        status = json.loads(r.read())
    assert status["backend"] == "torch" and status["requests"] >= 0
