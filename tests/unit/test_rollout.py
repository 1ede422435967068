"""Rollout nodes (`python -m yeto.rollout`): logprobs equal the trainer's recomputation
(torch and MLX), an observer node serves every merged Θ, adapters load in either
format on either backend, one weights version per request, batched = alone, and
bad requests get a 4xx while the node keeps serving.

Here: the checks that need no process, server or training (the others:
tests/integration/test_rollout.py)."""


import numpy as np

from yeto.rollout.generate import Row, SamplingParams, choose, log_softmax


def test_sampling_follows_temperature_top_k_and_top_p():
    lp = log_softmax(np.log(np.array([[0.5, 0.3, 0.15, 0.05]])))
    rng = np.random.default_rng(0)

    def freq(**kw):
        rows = [Row((1,), SamplingParams(**kw), rng)]
        draws = [int(choose(lp, rows)[0]) for _ in range(4000)]
        return np.bincount(draws, minlength=4) / len(draws)

    assert np.allclose(freq(temperature=1.0), [0.5, 0.3, 0.15, 0.05], atol=0.03)
    assert np.allclose(freq(temperature=0.0), [1, 0, 0, 0])
    assert np.allclose(freq(temperature=1.0, top_k=2), [0.625, 0.375, 0, 0], atol=0.03)
    assert np.allclose(freq(temperature=1.0, top_p=0.7), [0.625, 0.375, 0, 0], atol=0.03)
    cold = freq(temperature=0.5)  # p^2, renormalised
    assert np.allclose(cold, np.array([25, 9, 2.25, 0.25]) / 36.5, atol=0.03)
