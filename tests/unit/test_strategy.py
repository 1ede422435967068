"""The strategy objects (syncer.strategy): merge rules and outer optimizers, without a
server; a new one is one class."""

import numpy as np
import pytest

from syncer import state, strategy
from syncer.merge import MergeAccumulator
from syncer.messages import PushHeader
from syncer.run import Config, Run
from yeto import codec
from yeto.layout import Layout

N = 1000


def test_rules_weigh_pushes_as_named():
    assert strategy.Mean().weight(30) == 30.0 and strategy.Mean().weight(-1) == 0.0
    assert strategy.Uniform().weight(30) == 1.0
    assert strategy.Mean().factor(2.0, 3.0) is None
    assert strategy.RDA().factor(2.0, 3.0) == 1.5 and strategy.RDA().factor(0.0, 3.0) is None
    with pytest.raises(ValueError, match="unknown merge rule"):
        strategy.merge_rule("median")


def test_a_new_merge_rule_is_one_class():
    """A rule the library does not ship, plugged into the accumulator as it is."""
    class SqrtTokens(strategy.Mean):
        name = "sqrt"

        def weight(self, loss_tokens: int) -> float:
            return float(np.sqrt(max(loss_tokens, 0)))

    rng = np.random.default_rng(0)
    d = [rng.standard_normal(N).astype(np.float32) for _ in range(2)]
    acc = MergeAccumulator(N, SqrtTokens())
    for x, tokens in zip(d, (16, 64)):
        acc.add(codec.encode(x, "f32"), "f32", tokens)
    np.testing.assert_allclose(acc.result(), (4 * d[0] + 8 * d[1]) / 12, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mu", [0.5, 0.9])
def test_bias_corrected_nesterov_steps_fully_from_the_first_round(mu):
    """For a steady g, plain Nesterov's step grows from lr(1 + μ)g toward lr·g/(1 − μ);
    the bias-corrected one takes lr·g/(1 − μ) from round 1 on."""
    lr, g = 0.7, np.full(N, 0.01, np.float32)
    steps = {}
    for opt in (strategy.Nesterov(lr, mu), strategy.BiasCorrectedNesterov(lr, mu)):
        theta, m = np.zeros(N, np.float32), np.zeros(N, np.float32)
        moved = []
        for t in range(1, 4):
            before = theta.copy()
            opt.step(theta, m, g.copy(), t)
            moved.append(float((before - theta)[0]))
        steps[opt.name] = moved
    full = lr * 0.01 / (1 - mu)
    assert steps["nesterov"][0] == pytest.approx(lr * 0.01 * (1 + mu), rel=1e-5)
    assert steps["nesterov"][0] < steps["nesterov"][1] < steps["nesterov"][2] < full
    assert steps["nesterov-bc"] == pytest.approx([full] * 3, rel=1e-5)


def _committed_run(state_dir, outer: str, rounds: int = 3) -> Run:
    layout = Layout.from_shapes({"a.lora_A.weight": (N,)})
    run = Run(Config(quorum=1, outer=outer, outer_lr=0.7, outer_momentum=0.9,
                     state_dir=state_dir))
    gen = run.join("x", layout.specs, layout.fingerprint, "numpy", "w.safetensors",
                   {})["generation"]
    run.push(PushHeader("x", gen, 0, 0, 0, 0, 0, "f32", N, 4 * N, True, 0),
             codec.encode(np.zeros(N, np.float32), "f32"))
    for v in range(rounds):
        run.push(PushHeader("x", gen, v + 1, 0, v, 10, 1, "f32", N, 4 * N, False, v),
                 codec.encode(np.full(N, 0.01, np.float32), "f32"))
    run.tape.close()
    return run


def test_the_outer_optimizer_and_its_step_count_are_saved_and_resume(tmp_path):
    run = _committed_run(tmp_path / "s", "nesterov-bc")
    assert run.version == 3 and run.outer_steps == {0: 3}
    back = Run(Config(quorum=1, outer="nesterov-bc", outer_lr=0.7, outer_momentum=0.9,
                      state_dir=tmp_path / "s", resume=True))
    assert back.outer_steps == {0: 3} and back.m.tobytes() == run.m.tobytes()
    back.tape.close()
    with pytest.raises(state.StateError, match="--outer was 'nesterov-bc', now 'nesterov'"):
        Run(Config(quorum=1, outer="nesterov", outer_lr=0.7, outer_momentum=0.9,
                   state_dir=tmp_path / "s", resume=True))
