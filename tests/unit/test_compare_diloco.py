"""scripts/compare_diloco.py's arms (`yeto.testing.diloco_arms`) and report
(`yeto.testing.diloco_report`): the plans, the cache keys and the tables and RESULT lines
over made-up results. The runs themselves: tests/e2e/test_compare_diloco.py."""

import pytest

from yeto.testing import diloco_arms as da
from yeto.testing import diloco_report as rep


def test_cross_tables_place_each_arm_by_its_flags(capsys):
    """The outer grid and the wire cross put each arm's ratio to its reference (the mean
    over seeds, ± half the range) in the cell its flags name, and nowhere else."""

    _, arms, _ = da.plan("long")
    rows = {a.key: rep.Row(a) for a in arms if a.regime == "warm"}
    loss = {"warm:dp4": (2.0, 4.0), "warm:diloco4-H50-q4-dq4-lr04m05": (2.2, 4.2),
            "warm:diloco4-H50-q4-dq4-o04": (2.0, 4.0), "warm:diloco4-H50-q4-dq4": (1.0, 2.0),
            "warm:diloco4-H50-q4-dq4-m05": (3.0, 6.0), "warm:diloco4-H50-f32-nest": (2.0, 4.4),
            "warm:diloco4-H50-bf16-dq4-nest": (1.9, 3.6), "warm:diloco4-H50-q4-nest": (2.0, 4.0),
            "warm:diloco4-H50-q4-dq4-nest": (2.4, 4.0)}
    for key, (s0, s1) in loss.items():
        rows[key].results = {0: {"eval_loss": s0}, 1: {"eval_loss": s1}}
    rep.attach_ratios(rows)
    rep.print_grids(rows, md=True)
    rep.print_wires(rows, md=True)
    out = capsys.readouterr().out
    grid = out[out.index("outer grid, warm, k = 4"):out.index("wire, warm")]
    assert "| 0.4 | - | 1.0750 ± 0.0250 (2) | 1.0000 ± 0.0000 (2) |" in grid
    assert "| 0.7 | - | 1.5000 ± 0.0000 (2) | 1.1000 ± 0.1000 (2) |" in grid
    assert "| 1 | 0.5000 ± 0.0000 (2) | - | - |" in grid
    wire = out[out.index("wire, warm"):]
    assert "| f32 | 1.0500 ± 0.0500 (2) | - |" in wire
    assert "| bf16 | - | 0.9250 ± 0.0250 (2) |" in wire
    assert "| q4 | 1.0000 ± 0.0000 (2) | 1.1000 ± 0.1000 (2) |" in wire
    assert "k = 2" not in out and "scratch" not in out  # too few cells: no table


def test_q4_vs_f32_goal_compares_the_seeds_both_arms_ran():
    """The q4-vs-f32 gap is the ratio of mean losses over the seeds both arms ran, for
    q4 both ways and for q4 up with f32 down."""

    _, arms, _ = da.plan("long")
    rows = {a.key: rep.Row(a) for a in arms if a.regime == "warm"}
    rows["warm:diloco4-H50-f32-nest"].results = {0: {"eval_loss": 2.0}}
    rows["warm:diloco4-H50-q4-nest"].results = {0: {"eval_loss": 2.004}, 1: {"eval_loss": 9.0}}
    rows["warm:diloco4-H50-q4-dq4-nest"].results = {0: {"eval_loss": 2.1}, 1: {"eval_loss": 2.0}}
    lines = [x for x in rep.long_goal_lines(rows) if "goal=long_q4_vs_f32" in x]
    assert lines == [
        "RESULT goal=long_q4_vs_f32 arm=warm:H50 wire=q4/q4 met=no gap=+5.00% seeds=1",
        "RESULT goal=long_q4_vs_f32 arm=warm:H50 wire=q4/f32 met=yes gap=+0.20% seeds=1"]


def test_the_rules_table_and_goal_lines_say_what_ran(capsys):
    """--rules: each candidate's cells (ratio to dp<k> over the seeds both ran, ± half the
    range), "not run" where nothing ran, and a rule meets the goal only with every short
    and warm cell measured and met (n/a, naming the missing cells, before that)."""

    regimes, arms, seeds = da.plan("rules")
    assert seeds == [0, 1, 2] and set(regimes) == {"short", "warm", "scratch", "warm2m"}
    rows = {a.key: rep.Row(a) for a in arms}
    bytes_fewer = {"short": 0.01, "warm": 1 / 500}  # bytes per token ratio

    def put(key: str, losses, bpt=1.0):
        rows[key].results = {s: {"eval_loss": x, "bytes_per_token_ratio": bpt}
                             for s, x in enumerate(losses)}

    for key in ("short:dp4", "warm:dp4", "warm:dp8"):
        put(key, (2.0, 2.0, 2.0))
    put("short:diloco4-H50-q4-dq4", (2.02, 2.04, 2.06), bytes_fewer["short"])
    put("short:diloco4-H50-q4-dq4-o04", (2.3, 2.3, 2.3), bytes_fewer["short"])
    put("warm:diloco4-H100-q4-dq4-o04", (1.98, 2.0, 2.02), bytes_fewer["warm"])
    put("warm:diloco8-H100-q4-dq4-o04", (1.9, 1.9, 1.9), bytes_fewer["warm"])
    rep.attach_ratios(rows)
    rep.print_rules(rows, md=True)
    out = capsys.readouterr().out
    assert "| avg (nesterov/1.0/0.0) | 1.0200 ± 0.0100 (3) | not run |" in out
    assert "| o04 (nesterov/0.4/0.9) | 1.1500 ± 0.0000 (3) | 1.0000 ± 0.0100 (3) | " \
           "0.9500 ± 0.0000 (3) | not run | not run |" in out
    assert "bc (" not in out  # no cell ran
    lines = rep.rules_goal_lines(rows)
    assert ("RESULT goal=outer_rule rule=avg cell=short:k4:H50 met=yes ratio=1.0200+-0.0100 "
            "fewer_bytes=100 seeds=3 target_ratio=1.03 target_fewer=0") in lines
    assert ("RESULT goal=one_rule rule=avg met=n/a missing=warm:k4:H100,warm:k8:H100 "
            "cells=1/6") in lines
    assert "RESULT goal=one_rule rule=o04 met=no cells=3/6" in lines  # short: 1.15 > 1.03
    assert any(x.startswith("RESULT goal=outer_rule rule=o04 cell=warm:k4:H100 met=yes ")
               for x in lines)


def test_quick_runs_the_syncers_default_rule():
    """--quick runs the short cell of `DEFAULT`, which must be the rule, lr and momentum a
    syncer gets without flags for SFT islands (`auto` steps as nesterov-warmup then:
    tests/unit/test_strategy.py checks the bits)."""

    from syncer import strategy
    from syncer.run import Config

    default = strategy.outer_optimizer(Config.outer, Config.outer_lr, Config.outer_momentum)
    assert isinstance(default, strategy.RegimeNesterov)
    assert da.CANDIDATES[da.DEFAULT] == (strategy.WarmupNesterov.name, default.lr,
                                             default.momentum)
    _, quick, _ = da.plan("quick")
    assert [(a.key, a.kind) for a in quick][0] == ("short:dp4", "dp")
    assert [da.candidate_of(a) for a in quick[1:]] == [da.DEFAULT]


def test_a_reference_that_spiked_at_the_end_gives_no_ratio():
    """A dp run whose final held-out loss is over 5 % above its own best along the way
    is left out of the ratios, and the report names it."""

    _, arms, _ = da.plan("rules")
    rows = {a.key: rep.Row(a) for a in arms if a.regime == "short"}
    rows["short:dp4"].results = {
        0: {"eval_loss": 1.10, "curve": [[350, 1.11], [400, 1.10]]},
        2: {"eval_loss": 1.89, "curve": [[350, 1.11], [400, 1.89]]}}
    rows["short:diloco4-H50-q4-dq4"].results = {0: {"eval_loss": 1.12}, 2: {"eval_loss": 1.12}}
    rep.attach_ratios(rows)
    assert rows["short:diloco4-H50-q4-dq4"].ratios == {0: pytest.approx(1.12 / 1.10)}
    assert rep.spike_lines(rows) == [
        "RESULT note=reference_spiked arm=short:dp4 seed=2 eval_loss=1.8900 "
        "best_on_the_way=1.1100 (no ratio for this seed)"]


def test_the_larger_model_cell_runs_dp4_and_two_rules_on_the_small_model():
    """warm2m: the warm regime on the "small" tiny model (over 2M parameters), dp4 and
    LARGER_RULES only, each arm cached apart from the tiny model's; the tiny regimes'
    cache keys are the ones computed before sizes existed."""
    import hashlib
    import json


    regimes, arms, _ = da.plan("rules")
    warm, larger = regimes["warm"], regimes["warm2m"]
    assert larger.size == "small" and warm.size == "tiny"
    assert {**vars(larger), "name": "warm", "size": "tiny"} == vars(warm)  # only the model
    by = {a.key: a for a in arms}
    got = [(a.name, a.kind, da.candidate_of(a)) for a in arms if a.regime == "warm2m"]
    assert got[0][:2] == ("dp4", "dp")
    assert got[1:] == [(f"diloco4-H100-q4-dq4{'' if c == 'avg' else '-' + c}", "diloco", c)
                       for c in da.LARGER_RULES]
    assert "warmup" in da.LARGER_RULES
    assert [a.key for a in da.choose(arms, "warm2m:*warmup")] == [
        "warm2m:dp4", "warm2m:diloco4-H100-q4-dq4-warmup"]

    def digest(a, seed=0):
        cfg = da.config_of(a, regimes[a.regime], seed)
        return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]

    # the digests of runs/compare-rules/results/warm/ cached before sizes existed
    assert digest(by["warm:dp4"]) == "c759054e4111a12c"
    assert digest(by["warm:diloco4-H100-q4-dq4-warmup"]) == "035869ae0c5a4cd4"
    assert digest(by["warm2m:dp4"]) != digest(by["warm:dp4"])


def test_max_steps_caps_every_arm_and_keys_its_cache_apart():

    regimes, arms, _ = da.plan("rules")
    arm = next(a for a in arms if a.key == "warm2m:diloco4-H100-q4-dq4-warmup")
    (short,) = da.capped([arm], 300)
    assert (arm.steps, short.steps, short.H) == (5000, 300, 100)
    assert da.config_of(short, regimes["warm2m"], 0) != da.config_of(arm, regimes["warm2m"], 0)
    with pytest.raises(SystemExit, match="at least 1 step"):
        da.capped([arm], 0)


def test_real_runs_the_default_rule_and_averaging_against_dp_on_the_same_tokens():
    """--real (issue 45): per k in (2, 4), dp<k> (one island, k x the batch) and the
    default rule's and plain averaging's DiLoCo arms, every arm on the same tokens, at
    least 4 rounds, LoRA r16 on the real base; the base's path keys the cache, and the
    tiny regimes' keys do not change (see the digests above)."""

    from yeto.testing.real import SMOLLM2

    regimes, arms, seeds = da.plan("real")
    rg = regimes["real"]
    assert seeds == [0, 1] and list(regimes) == ["real"]
    assert (rg.base, rg.tuning, rg.lora_r, rg.data, rg.seq_len, rg.sim) == (
        str(SMOLLM2.path), "lora", 16, "docs", 128, True)
    assert da.REAL_RULES[0] == da.DEFAULT and "avg" in da.REAL_RULES
    assert [(a.name, da.candidate_of(a) if a.kind == "diloco" else a.kind) for a in arms] == [
        (n, c) for _, k, H in da.REAL_CELLS for n, c in (
            (f"dp{k}", "dp"), (f"diloco{k}-H{H}-q4-dq4-warmup", "warmup"),
            (f"diloco{k}-H{H}-q4-dq4", "avg"))]
    assert {k for _, k, _ in da.REAL_CELLS} == {2, 4}
    for a in arms:
        assert a.steps * a.batch * (1 if a.kind == "dp" else a.k) == rg.steps * rg.batch
        assert a.ref == f"dp{a.k}"
        if a.kind == "diloco":
            assert a.steps // a.H >= 4 and da.cell_of(a) == ("real", a.k, a.H)
    other = da.plan("real", "/elsewhere/model.gguf")[0]["real"]
    assert other.base == "/elsewhere/model.gguf"
    assert da.config_of(arms[1], other, 0) != da.config_of(arms[1], rg, 0)
    assert "base" not in da.config_of(arms[0], da.plan("rules")[0]["short"], 0)["regime"]


def test_the_real_table_and_goals_are_per_k_against_1_03(capsys):

    _, arms, _ = da.plan("real")
    rows = {a.key: rep.Row(a) for a in arms}
    (_, _, h2), (_, _, h4) = da.REAL_CELLS
    for key, losses in (("dp2", (2.0, 2.0)), ("dp4", (2.0, 2.0)),
                        (f"diloco2-H{h2}-q4-dq4-warmup", (2.02, 2.06)),
                        (f"diloco4-H{h4}-q4-dq4-warmup", (2.1, 2.1))):
        rows[f"real:{key}"].results = {s: {"eval_loss": x, "bytes_per_token_ratio": 0.1}
                                       for s, x in enumerate(losses)}
    rep.attach_ratios(rows)
    rep.print_rules(rows, md=True, cells=da.REAL_CELLS)
    out = capsys.readouterr().out
    assert (f"| rule (outer/lr/momentum) | real:k2:H{h2} | real:k4:H{h4} |\n" in out
            and "| warmup (nesterov-warmup/0.4/0.9) | 1.0200 ± 0.0100 (2) | "
                "1.0500 ± 0.0000 (2) |" in out)
    lines = rep.rules_goal_lines(rows, da.REAL_CELLS, ("real",))
    assert f"RESULT goal=outer_rule rule=warmup cell=real:k2:H{h2} met=yes ratio=1.0200+-" \
           "0.0100 fewer_bytes=10 seeds=2 target_ratio=1.03 target_fewer=0" in lines
    assert "RESULT goal=one_rule rule=warmup met=no cells=2/2" in lines
