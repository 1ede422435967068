"""The strategy objects (syncer.strategy): merge rules and outer optimizers, without a
server; a new one is one class."""

import numpy as np
import pytest

from syncer import state, strategy
from syncer.merge import MergeAccumulator
from syncer.messages import PushHeader
from syncer.run import Config, Run
from syncer.staging import WholePush
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
             WholePush(codec.encode(np.zeros(N, np.float32), "f32")))
    for v in range(rounds):
        run.push(PushHeader("x", gen, v + 1, 0, v, 10, 1, "f32", N, 4 * N, False, v),
                 WholePush(codec.encode(np.full(N, 0.01, np.float32), "f32")))
    run.tape.close()
    return run


def test_the_outer_optimizer_and_its_step_count_are_saved_and_resume(tmp_path):
    run = _committed_run(tmp_path / "s", "nesterov-bc")
    assert run.version == 3 and run.model.outer_steps == {0: 3}
    back = Run(Config(quorum=1, outer="nesterov-bc", outer_lr=0.7, outer_momentum=0.9,
                      state_dir=tmp_path / "s", resume=True))
    assert back.model.outer_steps == {0: 3} and back.model.m.tobytes() == run.model.m.tobytes()
    back.tape.close()
    with pytest.raises(state.StateError, match="--outer was 'nesterov-bc', now 'nesterov'"):
        Run(Config(quorum=1, outer="nesterov", outer_lr=0.7, outer_momentum=0.9,
                   state_dir=tmp_path / "s", resume=True))


# ---- the candidates of issue 33: each rule's arithmetic, and a resume that steps the same

def test_warmup_moves_from_plain_averaging_to_its_lr_and_momentum():
    opt = strategy.WarmupNesterov(0.4, 0.9)
    w = opt.WARMUP
    assert opt.coefficients(1) == (1.0, 0.0, 0.0)
    lr, mu, weight = opt.coefficients(1 + w // 2)
    assert (lr, mu, weight) == pytest.approx((0.7, 0.45, 0.45))
    assert opt.coefficients(1 + w) == pytest.approx((0.4, 0.9, 0.9))
    assert opt.coefficients(10 * w) == pytest.approx((0.4, 0.9, 0.9))
    theta, m, g = np.ones(N, np.float32), np.zeros(N, np.float32), np.full(N, 0.25, np.float32)
    opt.step(theta, m, g.copy(), 1)  # round 1: Θ − g, and m = g
    assert np.all(theta == 0.75) and np.all(m == 0.25)


def test_agreement_sets_lr_and_momentum_by_the_cosine_of_g_and_m():
    opt = strategy.AgreementNesterov(0.4, 0.9)
    g = np.zeros(N, np.float32)
    g[0] = 1.0
    cases = {"parallel": (g * 3, 1.0), "orthogonal": (np.roll(g, 1), 0.0),
             "against": (-g, 0.0), "60 degrees": (g + np.roll(g, 1) * np.sqrt(3), 0.5)}
    for name, (m, s) in cases.items():
        opt.begin(g, m.astype(np.float32), 3)
        assert opt.agreement == pytest.approx(s, abs=1e-6), name
        assert opt.coefficients(3) == pytest.approx((1 + (0.4 - 1) * s, 0.9 * s, 0.9 * s)), name
    opt.begin(g, None, 1)  # no momentum yet: plain averaging
    assert opt.coefficients(1) == (1.0, 0.0, 0.0)


def test_restart_empties_the_momentum_only_when_g_points_against_it():
    lr, mu = 0.4, 0.9
    opt = strategy.RestartNesterov(lr, mu)
    for sign, restarted in ((1, False), (-1, True)):
        theta, m = np.zeros(N, np.float32), np.full(N, 0.5, np.float32)
        g = np.full(N, 0.1 * sign, np.float32)
        opt.begin(g, m, 2)
        assert opt.restart is restarted
        opt.step(theta, m, g.copy(), 2)
        m_new = 0.1 * sign + (0 if restarted else mu * 0.5)
        assert m[0] == pytest.approx(m_new, rel=1e-6)
        assert theta[0] == pytest.approx(-lr * (0.1 * sign + mu * m_new), rel=1e-6)


def test_cosine_sums_across_chunks_and_is_zero_for_a_zero_vector():
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((1 << 20) + 5).astype(np.float32) for _ in range(2))
    want = float(a.astype(np.float64) @ b / np.linalg.norm(a.astype(np.float64))
                 / np.linalg.norm(b.astype(np.float64)))
    assert strategy.cosine(a, b) == pytest.approx(want, abs=1e-6)
    assert strategy.cosine(a, np.zeros_like(a)) == 0.0


def test_the_accumulators_step_shows_the_rule_the_whole_round():
    """`step_outer` calls `begin` once, with the fragment's whole sum and momentum (the
    sum, not yet divided: the cosine does not change), then steps as `step` does."""
    rng = np.random.default_rng(2)
    d = [rng.standard_normal(N).astype(np.float32) for _ in range(2)]
    m0 = (d[0] + d[1] + 2 * rng.standard_normal(N)).astype(np.float32)  # 0 < cos < 1
    acc = MergeAccumulator(N, strategy.Mean())
    for x in d:
        acc.add(codec.encode(x, "f32"), "f32", 10)
    opt = strategy.AgreementNesterov(0.4, 0.9)
    theta, m = np.zeros(N, np.float32), m0.copy()
    acc.step_outer(opt, theta, m, 2)
    g = (d[0] + d[1]) / 2
    s = max(0.0, strategy.cosine(g, m0))
    assert 0.1 < s < 0.9 and opt.agreement == pytest.approx(s, abs=1e-6)
    lr, mu = 1 + (0.4 - 1) * s, 0.9 * s
    m_want = mu * m0 + g
    np.testing.assert_allclose(m, m_want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(theta, -lr * (g + mu * m_want), rtol=1e-5, atol=1e-6)


def _push_rounds(run: Run, gen: int, rounds: range) -> None:
    """Round v's push: a change that turns as v grows (so agreement and restart vary)."""
    for v in rounds:
        x = np.cos(np.arange(N) * 0.01 + v * 1.3).astype(np.float32) * 0.01
        run.push(PushHeader("x", gen, v + 1, 0, v, 10, 1, "f32", N, 4 * N, False, v + 1),
                 WholePush(codec.encode(x, "f32")))


@pytest.mark.parametrize("outer", ["nesterov-warmup", "nesterov-agree", "nesterov-restart"])
def test_a_resumed_run_steps_as_one_that_never_stopped(tmp_path, outer):
    """The new rules keep no state beyond m and the step count, which are saved: a run
    stopped after round 3 and resumed takes round 4 to the same bits as one that ran on."""
    layout = Layout.from_shapes({"a.lora_A.weight": (N,)})
    runs = {}
    for name in ("through", "stopped"):
        cfg = Config(quorum=1, outer=outer, outer_lr=0.4, outer_momentum=0.9,
                     state_dir=tmp_path / name)
        run = Run(cfg)
        gen = run.join("x", layout.specs, layout.fingerprint, "numpy", "w.safetensors",
                       {})["generation"]
        run.push(PushHeader("x", gen, 0, 0, 0, 0, 0, "f32", N, 4 * N, True, 0),
                 WholePush(codec.encode(np.zeros(N, np.float32), "f32")))
        _push_rounds(run, gen, range(4 if name == "through" else 3))
        run.tape.close()
        runs[name] = run
    back = Run(Config(quorum=1, outer=outer, outer_lr=0.4, outer_momentum=0.9,
                      state_dir=tmp_path / "stopped", resume=True))
    gen = back.join("x", layout.specs, layout.fingerprint, "numpy", "w.safetensors",
                    {})["generation"]
    _push_rounds(back, gen, range(3, 4))
    back.tape.close()
    assert back.version == runs["through"].version == 4
    assert back.theta.tobytes() == runs["through"].theta.tobytes()
    assert back.model.m.tobytes() == runs["through"].model.m.tobytes()


# ---- the default rule follows the regime (issue 43) -------------------------------------
def _run_of(outer: str, regime: str, rounds: int, tmp_path=None) -> Run:
    """A run of `rounds` rounds under `outer` with one island that declares `regime`."""
    layout = Layout.from_shapes({"a.lora_A.weight": (N,)})
    run = Run(Config(quorum=1, outer=outer, outer_lr=0.4, outer_momentum=0.9,
                     state_dir=tmp_path))
    gen = run.join("x", layout.specs, layout.fingerprint, "numpy", "w.safetensors", {},
                   regime=regime)["generation"]
    run.push(PushHeader("x", gen, 0, 0, 0, 0, 0, "f32", N, 4 * N, True, 0),
             WholePush(codec.encode(np.zeros(N, np.float32), "f32")))
    _push_rounds(run, gen, range(rounds))
    return run


def test_auto_is_nesterov_warmup_for_sft_and_plain_averaging_for_rl():
    """The default (`auto`) steps as `nesterov-warmup` 0.4/0.9 for SFT islands and as
    plain averaging (nesterov 1/0) once a GRPO island has joined: the same bits as the
    named rules over 25 rounds, past the warm-up's 20."""
    for regime, same_as in (("sft", ("nesterov-warmup", 0.4, 0.9)), ("rl", ("nesterov", 1, 0))):
        auto = _run_of("auto", regime, 25)
        named = Run(Config(quorum=1, outer=same_as[0], outer_lr=same_as[1],
                           outer_momentum=same_as[2]))
        layout = Layout.from_shapes({"a.lora_A.weight": (N,)})
        gen = named.join("x", layout.specs, layout.fingerprint, "numpy", "w.safetensors",
                         {})["generation"]
        named.push(PushHeader("x", gen, 0, 0, 0, 0, 0, "f32", N, 4 * N, True, 0),
                   WholePush(codec.encode(np.zeros(N, np.float32), "f32")))
        _push_rounds(named, gen, range(25))
        assert auto.version == named.version == 25
        assert auto.theta.tobytes() == named.theta.tobytes(), regime
    # and the two regimes really differ (the warm-up's momentum from round 2 on)
    assert _run_of("auto", "sft", 25).theta.tobytes() != auto.theta.tobytes()


def test_auto_switches_once_an_rl_island_joins_and_says_so(tmp_path):
    run = _run_of("auto", "sft", 3, tmp_path)
    assert run.outer.coefficients(25) == (0.4, 0.9, 0.9)
    layout = Layout.from_shapes({"a.lora_A.weight": (N,)})
    run.join("grpo", layout.specs, layout.fingerprint, "torch", "w.safetensors", {},
             regime="rl")
    assert run.outer.coefficients(25) == (1.0, 0.0, 0.0)
    run.tape.close()
    tape = state_tape(tmp_path)
    switch = [r for r in tape if r.get("event") == "outer_rule"]
    assert len(switch) == 1 and switch[0]["learner"] == "grpo"
    assert "plain averaging" in switch[0]["detail"]
    merges = [r for r in tape if "responders" in r]
    # the tape says each round's step: the warm-up's (lr, μ) of rounds 1 and 2
    assert [v for r in merges[:2] for v in (r["step_lr"], r["step_momentum"])] == \
        pytest.approx([1.0, 0.0, 0.97, 0.045])


def test_a_named_rule_ignores_the_regime():
    run = _run_of("nesterov-warmup", "rl", 1)
    assert run.outer.coefficients(25) == (0.4, 0.9, 0.9)
    run.tape.close()


def test_an_unknown_regime_is_refused_before_anything_changes():
    from syncer.errors import Reject

    layout = Layout.from_shapes({"a.lora_A.weight": (N,)})
    run = Run(Config(quorum=1))
    with pytest.raises(Reject, match="unknown regime"):
        run.join("x", layout.specs, layout.fingerprint, "numpy", "w.safetensors", {},
                 regime="ppo\n")
    assert not run.members.rows and run.layout is None
    run.tape.close()


def state_tape(state_dir):
    from syncer.tape import read_tape

    return read_tape(state_dir / "tape.jsonl")
