"""The GRPO island (`python -m yeto.rl`): rewards, the GRPO arithmetic, a rollout node
killed mid-run (skipped, then used again when it is back), an island in a run with an
observer node (weights reach the node, staleness and logprob gap logged, held-out
reward measured on the trainer's own weights and never through a node), and the
`yeto demo --rl` run (slow).

Here: the checks that need no process, server or training (the others:
tests/integration/test_rl.py, tests/e2e/test_rl.py)."""


import numpy as np
import pytest
import torch

from yeto.rl.grpo import group_advantages, policy_loss
from yeto.rl.rewards import combine, exact_match, load_reward, reversal_accuracy


# ---- rewards and arithmetic ----------------------------------------------------------
def test_builtin_rewards():
    assert exact_match(" c b a ", reference="c b a") == 1.0
    assert exact_match("c b", reference="c b a") == 0.0
    assert reversal_accuracy("c b a", reference="c b a") == 1.0
    assert reversal_accuracy("c x a", reference="c b a") == pytest.approx(2 / 3)
    assert reversal_accuracy("c b a d", reference="c b a") == pytest.approx(3 / 4)
    assert reversal_accuracy("", reference="c b a") == 0.0
    prompt = "<|im_start|>user\nreverse: apple river stone<|im_end|>\n<|im_start|>assistant\n"
    assert reversal_accuracy("stone river apple", reference=None, prompt=prompt) == 1.0
    assert load_reward("exact_match") is exact_match
    assert load_reward("yeto.rl.rewards:reversal_accuracy") is reversal_accuracy
    both = combine([exact_match, reversal_accuracy])
    assert both("c b a", reference="c b a", prompt="") == 2.0
    for bad in ("nope", "yeto.rl.rewards:nothing", "no_such_module:f"):
        with pytest.raises(ValueError, match="--reward"):
            load_reward(bad)


def test_group_advantages_and_the_clipped_loss():
    adv = group_advantages(np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]]))
    assert np.allclose(adv[0], [1, -1, -1, 1], atol=1e-3) and np.allclose(adv[1], 0)
    assert np.allclose(group_advantages(np.array([[2.0, 0.0]]), scale=False), [[1, -1]])
    new = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mask = torch.ones(1, 2)
    loss, stats = policy_loss(new, new.detach(), torch.tensor([0.5]), mask, clip_eps=0.2)
    loss.backward()  # on policy: the gradient is −A per token
    assert torch.allclose(new.grad, torch.tensor([[-0.5, -0.5]]))
    assert stats["clipped"] == 0 and stats["ratio"] == pytest.approx(2.0)
    far = torch.tensor([[-1.0]], requires_grad=True)  # ratio e^1 > 1.2 with A > 0: clipped
    loss, stats = policy_loss(far, torch.tensor([[-2.0]]), torch.tensor([1.0]),
                              torch.ones(1, 1), clip_eps=0.2)
    loss.backward()
    assert far.grad.abs().sum() == 0 and stats["clipped"] == 1
    ref = torch.tensor([[-1.5]])
    loss, stats = policy_loss(torch.tensor([[-1.0]]), torch.tensor([[-1.0]]), torch.tensor([0.0]),
                              torch.ones(1, 1), 0.2, kl_coef=0.1, ref=ref)
    assert stats["kl"] == pytest.approx(np.exp(-0.5) + 0.5 - 1, rel=1e-5)


def test_the_mlx_clipped_loss_matches_the_torch_one():
    """`yeto.mlx.grpo.policy_loss` on random logprobs (ratios in and out of the clip
    range, advantages of both signs, a padded row): the same value, statistics and
    gradient as `yeto.rl.grpo.policy_loss`."""
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'yeto[mlx]')")
    from yeto.mlx.grpo import policy_loss as mlx_loss

    rng = np.random.default_rng(0)
    new, old = rng.normal(-2, 0.5, (3, 5)).astype(np.float32), rng.normal(-2, 0.5, (3, 5))
    ref, adv = rng.normal(-2, 0.5, (3, 5)).astype(np.float32), np.array([1.0, -0.5, 0.0])
    mask = np.ones((3, 5), np.float32)
    mask[2, 3:] = 0
    for kl_coef in (0.0, 0.1):
        t_new = torch.tensor(new, requires_grad=True)
        t_loss, t_st = policy_loss(t_new, torch.tensor(old, dtype=torch.float32),
                                   torch.tensor(adv, dtype=torch.float32), torch.tensor(mask),
                                   0.2, kl_coef, torch.tensor(ref))
        t_loss.backward()
        args = [mx.array(old.astype(np.float32)), mx.array(adv.astype(np.float32)),
                mx.array(mask), 0.2, kl_coef, mx.array(ref)]
        m_loss, m_st = mlx_loss(mx.array(new), *args)
        grad = mx.grad(lambda x, a=args: mlx_loss(x, *a)[0])(mx.array(new))
        assert float(m_loss) == pytest.approx(float(t_loss), abs=1e-6)
        assert all(float(m_st[k]) == pytest.approx(t_st[k], abs=1e-5) for k in t_st)
        assert 0 < t_st["clipped"] < 15 and (t_st["kl"] > 0) == (kl_coef > 0)
        assert np.abs(np.array(grad) - t_new.grad.numpy()).max() < 1e-6


def test_the_padded_batch_and_warmup():
    from yeto.rl.seqs import Seq, batch_of, warmup_scale

    b = batch_of([Seq((1, 2, 3), [4, 5], [-0.1, -0.2], 1.0, 0),
                  Seq((6,), [7, 8, 9], [-0.3, -0.4, -0.5], -1.0, 0)], pad_id=0)
    assert b.ids.tolist() == [[1, 2, 3, 4], [6, 7, 8, 0]]  # the last token is never an input
    assert b.mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert b.pos.tolist() == [[2, 3, 0], [0, 1, 2]] and b.tgt.tolist() == [[4, 5, 0], [7, 8, 9]]
    assert b.tmask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert np.allclose(b.behaviour, [[-0.1, -0.2, 0], [-0.3, -0.4, -0.5]])
    assert b.advantage.tolist() == [1.0, -1.0]
    assert [warmup_scale(s, 4) for s in (1, 2, 4, 9)] == [0.25, 0.5, 1.0, 1.0]
    assert warmup_scale(1, 0) == 1.0
