"""torch vs MLX GRPO trainer parity: one GRPO step on the same batch (same model,
same adapter weights, same sequences with behaviour logprobs and advantages) gives
the same loss, statistics and adapter gradient (per canonical tensor name) on both
backends, with and without the KL term, and the same weights after the step.

Here: the checks through training on the tiny model (the others: tests/unit/test_rl.py,
tests/integration/test_rl.py, tests/e2e/test_rl.py)."""


import numpy as np
import pytest

pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'yeto[mlx]')")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'yeto[mlx]')")

from helpers.rl import grpo_policies  # noqa: E402

from yeto.rl.seqs import Seq  # noqa: E402

pytestmark = pytest.mark.mlx

TOL = 1e-5  # absolute, on the loss (a mean over tokens) and on every gradient entry


def _seqs(policy, rng, n=6) -> list[Seq]:
    """`n` completions of random prompts, of different lengths (padding), with
    advantages of both signs and behaviour logprobs off the trainer's own by a random
    amount: ratios inside and outside the clip range, none near its edges."""
    from yeto.rl.grpo import completion_logprobs

    vocab = len(policy.tokenizer)
    seqs = [Seq(tuple(rng.integers(3, vocab, rng.integers(4, 9)).tolist()),
                rng.integers(3, vocab, rng.integers(2, 7)).tolist(), [], a, 0)
            for a in rng.choice([-1.5, -0.5, 0.7, 1.2], n)]
    lp, _ = completion_logprobs(policy.backend.model, seqs)
    for s, row in zip(seqs, lp.detach().numpy()):
        d = rng.choice([-1, 1], len(s.tokens)) * rng.uniform(0.02, 0.6, len(s.tokens))
        d[np.abs(np.abs(d) - 0.2) < 0.03] = 0.0  # log ratio near ±ε: no tie to break
        s.behaviour = (row[:len(s.tokens)] + d).tolist()
    return seqs


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_one_grpo_step_matches_across_backends(tiny_llama, kl_coef):
    torch_p, mlx_p = grpo_policies(tiny_llama, kl_coef=kl_coef)
    seqs = _seqs(torch_p, np.random.default_rng(1))
    total = sum(len(s.tokens) for s in seqs)
    got = {}
    for p in (torch_p, mlx_p):
        p.zero_grad()
        st = [p.backward(seqs[:4], total), p.backward(seqs[4:], total)]  # two micro-batches
        got[p.name] = ({k: sum(s[k] for s in st) / total for k in st[0]}, p.grads())
    (st_t, g_t), (st_m, g_m) = got["torch"], got["mlx"]
    assert 0 < st_t["clipped"] < 1 and (st_t["kl"] > 0) == (kl_coef > 0)
    for k in ("loss", "gap", "ratio", "kl"):
        assert abs(st_t[k] - st_m[k]) <= TOL, (k, st_t[k], st_m[k])
    assert st_t["clipped"] == st_m["clipped"]
    assert g_t.keys() == g_m.keys() and len(g_t) == 28
    worst = max(float(np.abs(g_t[k] - g_m[k]).max()) for k in g_t)
    assert worst <= TOL, worst
    assert max(float(np.abs(g).max()) for g in g_t.values()) > 100 * TOL  # a real gradient
    # the step: the gradient clipped to norm 0.5 (it is larger), warmup's lr scale 0.5.
    # Adam's first step is lr·g/(|g|+eps): where a gradient entry is float rounding noise
    # the two backends' noise differs and so may that entry's step, by up to 2·lr (as in
    # tests/integration/test_parity.py); everywhere the gradient is signal (|g| > 10x
    # TOL) the steps agree to TOL.
    norm = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in g_t.values()))
    assert norm > 0.5
    w0 = torch_p.flat()
    for p in (torch_p, mlx_p):
        p.step(0.5, 0.5)
    moved_t, moved_m = torch_p.flat() - w0, mlx_p.flat() - w0
    signal = np.concatenate([np.abs(g_t[s.name]).ravel() for s in torch_p.layout.specs]) > 10 * TOL
    assert signal.mean() > 0.95 and np.abs(moved_t).max() > 1e-4
    assert np.abs(moved_t - moved_m)[signal].max() <= TOL
    assert np.abs(moved_t - moved_m).max() <= 2 * 0.5e-3
