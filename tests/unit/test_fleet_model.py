"""The fleet-scale model (`yeto.sim.scale`): small fleets whose goodput is worked out by
hand from the model's stated rules, the same trace for both arms, and the shard split."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from yeto.codec import encoded_size
from yeto.sim import scale
from yeto.sim.__main__ import main as sim_main
from yeto.sim.diloco_model import DiLoCoConfig, DiLoCoModel
from yeto.sim.sync_model import SyncConfig, SyncModel
from yeto.sim.trace import FailureTrace, Fleet

P = 64_000  # q4: 36,000 bytes a push; f32: 256,000 bytes a broadcast


def fleet(step_s, bandwidth=1e15, latency=0.01) -> Fleet:
    n = len(step_s)
    return Fleet(np.array(step_s, float), np.full(n, bandwidth), np.full(n, latency))


def diloco(**kw) -> DiLoCoConfig:
    base = dict(params=P, fragments=1, sync_every=10, quorum=4, grace="fixed", grace_ms=0,
                shard_nic_bps=1e15, cpu_s_per_byte=0.0)
    return DiLoCoConfig(**{**base, **kw})


def test_diloco_without_failures_waits_for_a_slow_shard_as_worked_out():
    """4 equal islands, one fragment, pipeline 1, a 1e5 B/s shard: all push at once; the
    shard takes the 4 pushes one after another, the round commits when the last is in
    ("all"), then sends Θ to the 4 islands (fair share: all at the end). An island due
    again before Θ arrives waits, so a cycle lasts L = 4·up/nic + lat + 4·down/nic + lat,
    of which H·s trains."""
    nic, lat, h = 1e5, 0.01, 10
    up, down = encoded_size("q4", P), encoded_size("f32", P)
    assert (up, down) == (36_000, 256_000)
    cycle = 4 * up / nic + lat + 4 * down / nic + lat  # 11.70 s
    seconds = 20_000.0
    out = DiLoCoModel(diloco(shard_nic_bps=nic), fleet([1.0] * 4, latency=lat),
                      FailureTrace.none(4), seconds).run()
    assert out.round_s == pytest.approx(cycle, rel=1e-9)
    assert set(out.commits) == {"all"}
    # steady state trains H·s of every cycle; the first and last cycles are partial
    assert out.goodput == pytest.approx(h / cycle, abs=(cycle + h) / seconds)
    assert out.stalled_steps == pytest.approx(4 * seconds * (cycle - h) / cycle,
                                              rel=2 * cycle / seconds)
    assert out.lost_steps == 0 and out.refused == 0


def test_sync_without_failures_waits_for_the_slowest_island_or_the_all_reduce():
    # a step takes the slowest island's 2 s; 4 island-steps per step of the 3.5 paid
    out = SyncModel(SyncConfig(grad_bytes=0), fleet([1, 1, 1, 2]), FailureTrace.none(4),
                    1000.0).run()
    assert out.goodput == pytest.approx(2 / 3.5, abs=1e-3)
    # a ring all-reduce of 1 GB over 1 GB/s links, 2·(3/4) s, plus 2·log2(4) latencies
    out = SyncModel(SyncConfig(grad_bytes=10**9), fleet([1] * 4, bandwidth=1e9),
                    FailureTrace.none(4), 1000.0).run()
    step = 2 * 3 / 4 + 4 * 0.01
    assert out.goodput == pytest.approx(1 / step, abs=step / 1000)


def crash_trace() -> FailureTrace:
    """Island 0 crashes at 105.5 s and is back at 400 s; nothing else happens."""
    return FailureTrace([[(105.5, 400.0)], [], [], []], [[], [], [], []])


END = 1000.25  # a quarter step past 1000 s: steps ending at 1000 s count, none after


def test_one_crash_costs_each_arm_what_its_rules_say():
    f, trace, paid = fleet([1.0] * 4, latency=0.0), crash_trace(), 4 * END
    # Sync, 1 s steps, detect 20 s, re-form 30 s: 105 steps of 4; the step in progress at
    # 105.5 is lost; stalled to 155.5; steps of 3 until the boundary after island 0 is
    # back (400.5: 245 steps); a re-form to 430.5; 569 steps of 4 by 1000.25 s.
    sync = SyncModel(SyncConfig(grad_bytes=0, detect_s=20, reform_s=30), f, trace,
                     END).run()
    assert sync.useful_steps == 105 * 4 + 245 * 3 + 569 * 4
    assert sync.lost_steps == 4 and sync.reforms == 2
    assert sync.goodput == pytest.approx((105 * 4 + 245 * 3 + 569 * 4) / paid)
    # DiLoCo, H = 10, quorum 3, a fast shard: islands 1-3 train 1000 steps; island 0
    # trains 105, loses the 5 made since its push at step 100, is down until 400,
    # downloads Θ in a few picoseconds (fast links, no latency) and trains 600 more.
    out = DiLoCoModel(diloco(quorum=3), f, trace, END).run()
    assert out.lost_steps == 5
    assert out.made_steps == 3 * 1000 + 105 + 600
    assert out.goodput == pytest.approx((3000 + 100 + 600) / paid)
    assert out.down_steps == pytest.approx(400 - 105.5)
    assert out.goodput > sync.goodput


def args_for(*flags: str):
    args = scale.build_parser().parse_args(list(flags))
    scale.check(args)
    return args


SMALL = ("--islands", "40", "--params", "1e7", "--fragments", "8", "--sync-every", "40",
         "--hours", "1")


def test_the_sweep_repeats_exactly_for_a_seed_and_shares_one_trace():
    args = args_for(*SMALL, "--shards", "1,2", "--failures", "0.5", "--seed", "3")
    a, b = scale.sweep(args), scale.sweep(args)
    assert [dataclasses.asdict(p.diloco) for p in a] == [dataclasses.asdict(p.diloco) for p in b]
    assert [p.sync.goodput for p in a] == [p.sync.goodput for p in b]
    assert a[0].sync is a[1].sync  # one synchronous run per rate, beside every S
    assert a[0].diloco.down_steps == pytest.approx(a[1].diloco.down_steps)  # same crashes
    assert a[0].diloco.down_steps > 0
    other = scale.sweep(args_for(*SMALL, "--shards", "1", "--failures", "0.5", "--seed", "4"))
    assert other[0].diloco.down_steps != a[0].diloco.down_steps


def test_diloco_keeps_its_goodput_where_sync_loses_it_to_failures():
    args = args_for(*SMALL, "--shards", "4", "--failures", "0,2", "--shard-cores", "8")
    calm, failing = scale.sweep(args)
    assert calm.diloco.goodput > 0.95 and calm.sync.goodput > 0.9
    assert failing.sync.goodput < calm.sync.goodput - 0.2
    assert failing.diloco.goodput > failing.sync.goodput + 0.2


def test_more_shards_move_fewer_bytes_each():
    args = args_for(*SMALL, "--shards", "1,4", "--failures", "0", "--shard-cores", "8")
    one, four = scale.sweep(args)
    total = sum(one.diloco.shard_bytes_in) + sum(one.diloco.shard_bytes_out)
    each = [i + o for i, o in zip(four.diloco.shard_bytes_in, four.diloco.shard_bytes_out)]
    assert len(each) == 4
    assert sum(each) == pytest.approx(total, rel=0.02)  # the same pushes and broadcasts
    for b in each:  # 8 equal fragments, 2 a shard
        assert b == pytest.approx(total / 4, rel=0.05)


def test_the_command_line_prints_a_result_per_point_and_the_goal(capsys):
    assert sim_main([*SMALL, "--shards", "1,2", "--failures", "0,1"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("RESULT")]
    assert len(lines) == 5
    for key in ("round_s=", "shard_gb_in=", "shard_cpu_s=", "goodput_diloco=",
                "goodput_sync=", "ratio="):
        assert all(key in ln for ln in lines[:4])
    assert lines[-1].startswith("RESULT goal=")


@pytest.mark.parametrize("flags, message", [
    (("--shards", "32"), "--fragments >= 32"),
    (("--quorum", "1.5"), "--quorum"),
    (("--failures", "0,-1"), "rates >= 0"),
])
def test_bad_settings_are_refused_with_the_flag(capsys, flags, message):
    with pytest.raises(SystemExit):
        sim_main([*SMALL, *flags])
    assert message in capsys.readouterr().err
