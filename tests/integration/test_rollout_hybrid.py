"""Batched rollouts of hybrid models (conv or SSM blocks beside attention), on torch
and MLX: the rows of one batch, prompts of different lengths, sample what each row
samples alone: the same token ids, logprobs within 1e-5.

LFM2 (short-conv blocks: a conv state), Granite-4.0-H (granitemoehybrid: mamba2
blocks, a conv and an SSM state) and Mamba (no attention at all: the batch has no
keys, and no padding mask goes to its mixers) by default; eleven more hybrids and
longer generations under ``-m slow``. Each row's logprobs are also checked against
one forward over the whole sequence without a cache. The models are
`yeto.testing.servable`'s tiny random-weight ones, with a random LoRA on top."""

import json
import urllib.request

import numpy as np
import pytest

from yeto.rollout.engine import stop_token_ids
from yeto.rollout.generate import SamplingParams, generate, make_rows
from yeto.testing.servable import servable_model

TOL = 1e-5
#: 11 tokens, 2 (shorter than every conv kernel here: 3 and 4), 5
PROMPTS = [[40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [7, 9], [300, 301, 302, 5, 6]]
ARCHS = ["lfm2", "granitemoehybrid", "mamba"]
SLOW_ARCHS = ["falcon_h1", "nemotron_h", "qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2_moe",
              "mamba2", "falcon_mamba", "jamba", "kimi_linear", "olmo_hybrid"]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models: one thread is faster, and far faster on a loaded machine (two
    threads spin for each other's cores)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    built: dict[str, object] = {}

    def get(arch: str):
        if arch not in built:
            built[arch] = servable_model(arch, tmp_path_factory.mktemp(arch))
        return built[arch]

    return get


def _engine(backend: str, model_dir):
    if backend == "mlx":
        pytest.importorskip("mlx_lm", reason="mlx-lm is not installed")
        from yeto.rollout.mlx_engine import MLXEngine

        engine = MLXEngine(model_dir)
    else:
        from yeto.rollout.torch_engine import TorchEngine

        engine = TorchEngine(model_dir)
    # a LoRA that changes the outputs (B is not zero)
    engine.set_weights(np.random.default_rng(1).normal(0, 0.05, engine.layout.numel)
                       .astype(np.float32))
    return engine


def _rows(n: int, max_tokens: int):
    """`n` rows per prompt; each prompt's rows end at another step (so rows leave the
    batch mid-way), seeded sampling for two prompts, greedy for one."""
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=max_tokens // 2, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=max_tokens - 2, temperature=0.8, top_p=0.9, seed=6,
                             ignore_eos=True)]
    return [r for i, (p, sp) in enumerate(zip(PROMPTS, params)) for r in make_rows(p, sp, n, i)]


def _hybrid_state(backend: str, state) -> bool:
    """Whether a merged batch state holds conv or recurrent states."""
    if backend == "mlx":
        from mlx_lm.models.cache import ArraysCache, CacheList

        parts = [p for c in state for p in (c.caches if isinstance(c, CacheList) else [c])]
        return any(isinstance(c, ArraysCache) and c.batch_size > 1 for c in parts)
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in state.cache.layers)


def _recomputed(engine, backend: str, prompt, tokens) -> np.ndarray:
    """The logprobs of `tokens` after `prompt` from one forward over the whole
    sequence, without a cache (the reference for the cached, batched path)."""
    from yeto.rollout.generate import log_softmax

    ids = list(prompt) + list(tokens[:-1])
    if backend == "mlx":
        import mlx.core as mx

        logits = np.array(engine.model(mx.array([ids]))[0].astype(mx.float32))
    else:
        import torch

        with torch.inference_mode():
            logits = engine._lm(input_ids=torch.tensor([ids])).logits[0].float().numpy()
    lp = log_softmax(logits[len(prompt) - 1:])
    return lp[np.arange(len(tokens)), tokens]


def _batched_equals_alone(engine, backend: str, n: int, max_tokens: int) -> None:
    sizes, states = [], []
    decode, merge = engine.decode, engine.merge
    engine.decode = lambda state, tokens: (sizes.append(len(tokens)), decode(state, tokens))[1]
    engine.merge = lambda caches: states.append(merge(caches)) or states[-1]
    batched = generate(engine, _rows(n, max_tokens), [], lambda ids: "")
    assert sizes[0] == len(PROMPTS) * n and min(sizes) < sizes[0]  # batched; rows left
    assert _hybrid_state(backend, states[0])
    alone = [generate(engine, [row], [], lambda ids: "")[0] for row in _rows(n, max_tokens)]
    assert len({tuple(o.token_ids) for o in batched}) > 1
    for row, a, b in zip(_rows(n, max_tokens), alone, batched, strict=True):
        assert a.token_ids == b.token_ids
        assert np.abs(np.array(a.logprobs) - np.array(b.logprobs)).max() <= TOL
        want = _recomputed(engine, backend, row.prompt, b.token_ids)
        assert np.abs(np.array(b.logprobs) - want).max() <= TOL


@pytest.mark.parametrize("backend", ["torch", pytest.param("mlx", marks=pytest.mark.mlx)])
@pytest.mark.parametrize("arch", ARCHS)
def test_batched_rows_sample_what_they_sample_alone(arch, backend, build):
    _batched_equals_alone(_engine(backend, build(arch)), backend, n=2, max_tokens=6)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", pytest.param("mlx", marks=pytest.mark.mlx)])
@pytest.mark.parametrize("arch", [*ARCHS, *SLOW_ARCHS])
def test_long_batches_sample_what_they_sample_alone(arch, backend, build):
    _batched_equals_alone(_engine(backend, build(arch)), backend, n=4, max_tokens=40)


def test_a_node_serves_lfm2_batched(build):
    """One request (three prompts: one batch) through a node's HTTP server: each
    choice is what its row samples alone."""
    from yeto.rollout.server import RolloutNode, serve_in_thread

    engine = _engine("torch", build("lfm2"))
    node = RolloutNode(engine, model_name="lfm2",
                       eos_ids=stop_token_ids(engine.model_dir, engine.tokenizer))
    server, url = serve_in_thread(node)
    try:
        body = dict(prompt=PROMPTS, n=1, max_tokens=5, temperature=1.0, seed=9, logprobs=0,
                    ignore_eos=True, return_tokens_as_token_ids=True)
        req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            choices = json.loads(r.read())["choices"]
    finally:
        server.shutdown()
        server.server_close()
        node.close()
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=9, logprobs=0, ignore_eos=True)
    rows = [r for i, p in enumerate(PROMPTS) for r in make_rows(p, params, 1, i)]
    assert len(choices) == len(rows)
    for c, row in zip(sorted(choices, key=lambda c: c["index"]), rows):
        alone = generate(engine, [row], [], lambda ids: "")[0]
        ids = [int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]]
        assert ids == alone.token_ids
        assert np.abs(np.array(c["logprobs"]["token_logprobs"]) - alone.logprobs).max() <= TOL


@pytest.mark.parametrize("backend", ["torch", pytest.param("mlx", marks=pytest.mark.mlx)])
def test_a_model_it_cannot_batch_is_refused_up_front(backend, build):
    """RecurrentGemma keeps sliding-window attention beside its recurrent blocks, which
    neither engine batches: the engine refuses it when built (the node exits with the
    reason), not at the first request."""
    with pytest.raises(ValueError, match=r"layer \d+ keeps a .*another engine"):
        _engine(backend, build("recurrent_gemma"))
