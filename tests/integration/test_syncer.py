"""The syncer over real gRPC on loopback, driven by synthetic numpy islands.

Here: the checks through in-process servers, training or the sim (the others:
tests/e2e/test_syncer.py)."""


import hashlib
import json
import time

import grpc
import numpy as np
import pytest
from helpers.syncer import (
    AVERAGING,
    join_all,
    make_client,
    push_delta,
    running_syncer,
    wait_version,
)
from helpers.wait import wait_until

from syncer.tape import read_tape
from yeto import codec
from yeto.proto import yeto_pb2 as pb
from yeto.proto import yeto_pb2_grpc as pb_grpc
from yeto.transport import PushReply, Refused


def test_token_weighted_nesterov_matches_hand_computation(toy_layout, rng, tmp_state):
    lr, mu = 0.7, 0.9
    init = rng.standard_normal(toy_layout.numel).astype(np.float32)
    tokens = [100, 300, 600]
    cfg = dict(quorum=3, outer="nesterov", outer_lr=lr, outer_momentum=mu, state_dir=tmp_state)
    with running_syncer(**cfg) as (run, addr):
        clients = join_all(addr, toy_layout, ["a", "b", "c"], init)
        theta0 = clients[0].wait_one(timeout=20).theta
        for c in clients[1:]:
            np.testing.assert_array_equal(c.wait_one(timeout=20).theta, theta0)
        np.testing.assert_array_equal(theta0, init)  # seeded from the first island, bit-exact
        theta, m = init.astype(np.float64), np.zeros(toy_layout.numel)
        for r in range(4):
            deltas = [rng.standard_normal(toy_layout.numel).astype(np.float32) * 0.1
                      for _ in clients]
            for c, d, t in zip(clients, deltas, tokens):
                assert push_delta(c, d, t, base=r, seq=r).accepted
            g = sum(t * d.astype(np.float64) for d, t in zip(deltas, tokens)) / sum(tokens)
            m = mu * m + g
            theta = theta - lr * (g + mu * m)
            got = [c.wait_one(timeout=20) for c in clients]
            assert all(x.version == r + 1 for x in got)
            np.testing.assert_allclose(got[0].theta, theta, atol=1e-6)
            np.testing.assert_allclose(run.momentum, m, atol=1e-6)
        for c in clients:
            c.close()
    merges = [r for r in read_tape(tmp_state / "tape.jsonl") if r["event"] == "merge"]
    assert [r["round"] for r in merges] == [1, 2, 3, 4]
    for rec in merges:
        assert sorted((x["learner"], x["tokens"]) for x in rec["responders"]) == \
            [("a", 100), ("b", 300), ("c", 600)]
        assert rec["quorum"] == 3 and rec["bytes_in"] == 3 * 4 * toy_layout.numel
        assert abs(sum(x["share"] for x in rec["responders"]) - 1) < 1e-9


def test_round_one_waits_for_quorum(toy_layout, rng):
    init = rng.standard_normal(toy_layout.numel).astype(np.float32)
    with running_syncer(quorum=2) as (run, addr):
        a = make_client(addr, "a", toy_layout)
        a.start(init)
        assert wait_until(lambda: run.theta is not None)
        assert a.wait_one(timeout=1.0) is None and not run.started  # alone: no round 1
        # and pushes are refused until it starts
        with pytest.raises(Refused, match="FAILED_PRECONDITION.*waiting for quorum"):
            push_delta(a, init, 10, base=0, seq=0)
        b = make_client(addr, "b", toy_layout)
        b.start(init)
        assert a.wait_one(timeout=20).version == 0 and b.wait_one(timeout=20).version == 0
        assert run.started
        a.close(), b.close()


def test_silent_island_does_not_stall_past_timeout(toy_layout, rng, tmp_state):
    init = np.zeros(toy_layout.numel, dtype=np.float32)
    with running_syncer(quorum=2, round_timeout_s=1.0, grace_ms=0, state_dir=tmp_state,
                        **AVERAGING) as (run, addr):
        a, b = join_all(addr, toy_layout, ["a", "b"], init)
        a.wait_one(timeout=20), b.wait_one(timeout=20)
        t0 = time.monotonic()
        delta = np.full(toy_layout.numel, 0.5, np.float32)
        push_delta(a, delta, 10, base=0, seq=0)  # b never pushes
        got = a.wait_one(timeout=60)
        assert got is not None and got.version == 1
        assert time.monotonic() - t0 >= 1.0  # not before the timeout (never a bound above)
        np.testing.assert_array_equal(got.theta, init - delta)
        a.close(), b.close()
    rec = [r for r in read_tape(tmp_state / "tape.jsonl") if r["event"] == "merge"][0]
    assert rec["reason"] == "timeout" and [x["learner"] for x in rec["responders"]] == ["a"]


def test_late_and_duplicate_pushes_follow_the_stated_rule(toy_layout, tmp_state):
    """Rounds commit on quorum at once (grace 0) and never by the clock (timeout 10 min),
    so the order of the pushes alone decides which round each one lands in."""
    init = np.zeros(toy_layout.numel, dtype=np.float32)
    one = np.ones(toy_layout.numel, np.float32)
    with running_syncer(quorum=2, round_timeout_s=600, grace_ms=0, state_dir=tmp_state,
                        outer_lr=1.0, outer_momentum=0.0, max_staleness=1) as (run, addr):
        a, b, c = join_all(addr, toy_layout, ["a", "b", "c"], init)
        for x in (a, b, c):
            assert x.wait_one(timeout=20).version == 0
        # round 1: a and c make the quorum; it commits without b
        assert push_delta(a, one, 10, base=0, seq=0).accepted
        assert push_delta(c, one, 10, base=0, seq=0) == PushReply(True, "accepted", 2, 0)
        assert run.version == 1
        # b pushes against version 0: late by one commit, accepted into round 2
        assert push_delta(b, 2 * one, 10, base=0, seq=0) == PushReply(True, "accepted", 2, 1)
        # the same seq again is a duplicate, never merged twice
        assert push_delta(b, 2 * one, 10, base=0, seq=0) == PushReply(False, "duplicate", 2, 0)
        assert run.version == 1 and run.rounds.open[0].learners == {"b"}
        # a's push makes round 2's quorum: b's late work and a's merge, equally weighted
        assert push_delta(a, 4 * one, 10, base=1, seq=1).accepted and run.version == 2
        # c is now two commits behind (max_staleness 1): refused, never mixed in
        with pytest.raises(Refused, match="2 versions stale"):
            push_delta(c, one, 10, base=0, seq=1)
        np.testing.assert_array_equal(wait_version(a, 2).theta, init - one - 3 * one)
        for x in (a, b, c):
            x.close()
    tape = read_tape(tmp_state / "tape.jsonl")
    merges = [r for r in tape if r["event"] == "merge"]
    assert [r["reason"] for r in merges] == ["quorum", "quorum"]
    assert [(x["learner"], x["staleness"]) for x in merges[1]["responders"]] == \
        [("b", 1), ("a", 0)]
    assert [r["duplicates"] for r in merges] == [0, 1]
    kinds = [r["kind"] for r in tape if r["event"] == "rejected"]
    assert kinds == ["duplicate", "push:precondition"]


def test_q4_wire_within_documented_bound(toy_layout, rng):
    init = rng.standard_normal(toy_layout.numel).astype(np.float32)
    deltas = [rng.standard_normal(toy_layout.numel).astype(np.float32) * 0.05 for _ in range(3)]
    tokens = [5, 10, 20]
    results = {}
    for enc in ("f32", "q4"):
        with running_syncer(quorum=3, outer_lr=0.7, outer_momentum=0.9) as (run, addr):
            clients = join_all(addr, toy_layout, ["a", "b", "c"], init)
            for c in clients:
                c.wait_one(timeout=20)
            for c, d, t in zip(clients, deltas, tokens):
                push_delta(c, d, t, base=0, seq=0, encoding=enc)
            results[enc] = clients[0].wait_one(timeout=20).theta
            for c in clients:
                c.close()
    # Θ moves by lr·(1+μ)·g, and g's error is the weighted mean of per-push q4 errors
    bound = sum(t * codec.q4_error_bound(d) for d, t in zip(deltas, tokens)) / sum(tokens)
    err = np.abs(results["q4"] - results["f32"])
    assert (err <= 0.7 * 1.9 * bound + 1e-6).all()
    assert err.max() > 0  # the q4 path really quantized


def test_bad_pushes_are_refused_and_leave_state_unchanged(toy_layout, rng, tmp_state):
    init = rng.standard_normal(toy_layout.numel).astype(np.float32)
    with running_syncer(quorum=1, state_dir=tmp_state) as (run, addr):
        a = make_client(addr, "a", toy_layout)
        a.start(init)
        a.wait_one(timeout=20)
        before = run.theta.copy()
        bad = np.ones(toy_layout.numel, np.float32)
        bad[7] = np.nan
        payload = bytearray(codec.encode(np.ones(toy_layout.numel, np.float32), "f32"))
        payload[28:32] = np.array([np.inf], np.float32).tobytes()
        with pytest.raises(Refused, match="INVALID_ARGUMENT.*non-finite"):
            a.push(bytes(payload), encoding="f32", base_version=0, loss_tokens=1, steps=1,
                   seq=0).result(timeout=20)
        with pytest.raises(Refused, match="INVALID_ARGUMENT"):
            a.push(b"\0" * 12, encoding="f32", base_version=0, loss_tokens=1, steps=1,
                   seq=0).result(timeout=20)
        np.testing.assert_array_equal(run.theta, before)
        assert run.version == 0 and run.rounds.open[0].acc.count == 0
        # the syncer still serves: a good push commits
        assert push_delta(a, np.full(toy_layout.numel, 0.1, np.float32), 5, base=0, seq=0).accepted
        assert a.wait_one(timeout=20).version == 1
        a.close()


def test_layout_mismatch_names_first_differing_tensor(toy_layout, rng):
    from yeto.layout import Layout

    other = Layout.from_shapes({s.name: (s.shape if i != 2 else (8, 16))
                                for i, s in enumerate(toy_layout.specs)})
    with running_syncer(quorum=1) as (run, addr):
        a = make_client(addr, "a", toy_layout)
        a.start(np.zeros(toy_layout.numel, np.float32))
        a.wait_one(timeout=20)
        b = make_client(addr, "b", other)
        b.start(np.zeros(other.numel, np.float32))
        assert wait_until(lambda: b.fatal is not None)
        assert toy_layout.specs[2].name in b.fatal and "[4, 16]" in b.fatal and "[8, 16]" in b.fatal
        a.close(), b.close()


def test_wrong_token_is_unauthenticated(toy_layout):
    with running_syncer(token="s3cret", quorum=1) as (run, addr):
        c = make_client(addr, "a", toy_layout, token="wrong")
        c.start(np.zeros(toy_layout.numel, np.float32))
        assert wait_until(lambda: c.fatal is not None)
        assert "token" in c.fatal and not run.members.rows
        c.close()
        ok = make_client(addr, "a", toy_layout, token="s3cret")
        ok.start(np.zeros(toy_layout.numel, np.float32))
        assert ok.wait_one(timeout=20).version == 0
        ok.close()


def test_q4_downlink_keeps_islands_bit_identical_and_finishes_exact(toy_layout, rng, tmp_state):
    init = rng.standard_normal(toy_layout.numel).astype(np.float32)
    with running_syncer(quorum=2, downlink="q4", state_dir=tmp_state) as (run, addr):
        a, b = join_all(addr, toy_layout, ["a", "b"], init)
        a.wait_one(timeout=20), b.wait_one(timeout=20)
        for r in range(5):
            for c in (a, b):
                d = rng.standard_normal(toy_layout.numel).astype(np.float32) * 0.05
                push_delta(c, d, 10, base=r, seq=r, encoding="q4")
            ga, gb = a.wait_one(timeout=20), b.wait_one(timeout=20)
            assert ga.version == gb.version == r + 1
            assert ga.theta.tobytes() == gb.theta.tobytes() == run.downlink.island_theta.tobytes()
            # the islands' Θ tracks Θ within one q4 step of the update (the gap rides along)
            assert not np.array_equal(run.downlink.island_theta, run.theta)
        late = make_client(addr, "late", toy_layout)  # a late joiner gets the islands' Θ
        late.start(init)
        assert late.wait_one(timeout=20).theta.tobytes() == run.downlink.island_theta.tobytes()
        for c in (a, b, late):
            c.close()
    merges = [r for r in read_tape(tmp_state / "tape.jsonl") if r["event"] == "merge"]
    assert merges[-1]["bytes_out"] == 2 * codec.encoded_size("q4", toy_layout.numel)
    assert merges[-1]["bytes_out"] < 2 * 4 * toy_layout.numel / 5


def test_final_broadcast_is_exact_f32_with_q4_downlink(toy_layout, rng):
    init = rng.standard_normal(toy_layout.numel).astype(np.float32)
    with running_syncer(quorum=1, downlink="q4", rounds=3) as (run, addr):
        a = make_client(addr, "a", toy_layout)
        a.start(init)
        a.wait_one(timeout=20)
        for r in range(3):
            push_delta(a, rng.standard_normal(toy_layout.numel).astype(np.float32) * 0.05, 10,
                  base=r, seq=r, encoding="q4")
            got = a.wait_one(timeout=20)
        assert got.final and got.theta.tobytes() == run.theta.tobytes()
        a.close()


@pytest.mark.parametrize("downlink", ["q4", "f32"])
def test_the_join_reply_says_the_downlink_so_a_streaming_island_never_rejoins(
        toy_layout, rng, downlink):
    """An island that keeps no copy of Θ (`stream_broadcasts`) learns from the join
    reply that updates will come compressed, keeps Θ from the first broadcast, and
    applies every update on its first connection."""
    with running_syncer(quorum=1, downlink=downlink) as (run, addr):
        a = make_client(addr, "a", toy_layout)
        a.stream_broadcasts()
        a.start(np.zeros(toy_layout.numel, np.float32))
        a.wait_one(timeout=20)
        generation = a.generation
        for r in range(2):
            push_delta(a, rng.standard_normal(toy_layout.numel).astype(np.float32) * 0.05, 10,
                  base=r, seq=r, encoding="q4")
            got = a.wait_one(timeout=20)
            # what islands hold
            held = run.theta if downlink == "f32" else run.downlink.island_theta
            assert got.version == r + 1 and got.theta.tobytes() == held.tobytes()
        assert a.generation == generation  # no rejoin to learn the downlink
        a.close()


def test_streaming_fragments_merge_in_turn_and_end_identical(toy_layout, tmp_state):
    """P = 4 fragments, blocking islands: each fragment is merged in turn; when an
    island applies fragment f its slice equals Θ_f bit for bit (the other slices carry
    local steps), and at the end every island holds the syncer's final Θ exactly."""
    import threading

    from yeto.island import FlatWeights, Island

    P, H, steps = 4, 8, 64
    targets = [np.full(toy_layout.numel, float(i + 1), np.float32) for i in range(2)]
    slices_ok, finals = [], {}
    with running_syncer(quorum=2, fragments=P, state_dir=tmp_state) as (run, addr):
        def island(i):
            w = {"v": np.zeros(toy_layout.numel, np.float32)}

            def on_apply(got):
                frag = isl.fragments[got.fragment]
                slices_ok.append(np.array_equal(w["v"][frag.start:frag.stop], got.theta))

            def set_w(x):
                w["v"] = x.copy()

            isl = Island(FlatWeights(toy_layout, lambda: w["v"].copy(), set_w),
                         client=make_client(addr, f"i{i}", toy_layout), sync_every=H,
                         wire="f32", blocking=True)
            isl.on_apply = lambda got: None
            isl.start()
            isl.on_apply = lambda got: on_apply(got) if not got.final else None
            for _ in range(steps):
                w["v"] -= 0.1 * (w["v"] - targets[i])
                isl.after_step(10)
            isl.finish()
            finals[i] = w["v"].copy()

        threads = [threading.Thread(target=island, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        final_theta = run.theta.copy()
    merges = [r for r in read_tape(tmp_state / "tape.jsonl") if r["event"] == "merge"]
    frags = [r["fragment"] for r in merges]
    assert set(frags) == set(range(P)) and frags[:P] == list(range(P))  # staggered, in turn
    per_round = {r["bytes_in"] for r in merges if r["reason"] == "all"}
    assert max(per_round) <= 2 * 4 * toy_layout.numel / P + 64  # ~1/P of the bytes per round
    assert slices_ok and all(slices_ok)
    assert finals[0].tobytes() == finals[1].tobytes() == final_theta.tobytes()


def test_frozen_a_is_rebuilt_into_the_final_adapter(tmp_state):
    """Frozen-A mode: only B travels; the syncer regenerates A from the shared seed."""
    from safetensors.numpy import load_file

    from yeto import frozen
    from yeto.layout import Layout

    a_shapes = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (4, 16)}
    b_layout = Layout.from_shapes(
        {"base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": (16, 4)})
    with running_syncer(quorum=1, rounds=1, state_dir=tmp_state) as (run, addr):
        c = make_client(addr, "a", b_layout, weights_file="adapter_model.safetensors",
                        export_files={frozen.EXPORT_FILE: frozen.describe(7, a_shapes),
                                      "adapter_config.json": "{}"})
        c.start(np.zeros(b_layout.numel, np.float32))
        c.wait_one(timeout=20)
        push_delta(c, np.ones(b_layout.numel, np.float32), 5, base=0, seq=0)
        assert c.wait_one(timeout=20).final
        c.close()
    final = load_file(tmp_state / "final" / "adapter_model.safetensors")
    name = next(iter(a_shapes))
    assert np.array_equal(final[name], frozen.frozen_lora_a(name, (4, 16), 7))
    assert np.abs(final[name]).max() <= 0.25 and final[name].std() > 0.05  # U(±1/√16)
    assert not (tmp_state / "final" / frozen.EXPORT_FILE).exists()


def test_heartbeat_mid_round_reports_the_open_round(toy_layout):
    """Round 1 is opened by a's push and held open (b has not pushed; grace and timeout
    are far away); a Heartbeat then reports it, and after b's push, round 2."""
    init = np.zeros(toy_layout.numel, np.float32)
    one = np.ones(toy_layout.numel, np.float32)
    with running_syncer(quorum=2, grace_ms=600_000, round_timeout_s=600) as (run, addr), \
            grpc.insecure_channel(addr) as channel:
        a, b = join_all(addr, toy_layout, ["a", "b"], init)
        assert a.wait_one(timeout=20).version == 0 and b.wait_one(timeout=20).version == 0
        stub = pb_grpc.SyncerStub(channel)

        def heartbeat(c):
            return stub.Heartbeat(pb.HeartbeatRequest(learner_id=c.learner_id,
                                                      generation=c.generation, step=3),
                                  timeout=20)

        assert push_delta(a, one, 10, base=0, seq=0).accepted
        assert run.rounds.open[0].learners == {"a"} and run.version == 0  # round 1 is open
        for c in (a, b):
            r = heartbeat(c)
            assert (r.version, r.round, r.finished) == (0, 1, False)
        assert push_delta(b, one, 10, base=0, seq=0).accepted  # every island pushed: commits
        r = heartbeat(a)
        assert (r.version, r.round, r.finished) == (1, 2, False)
        with pytest.raises(grpc.RpcError) as e:  # a stale connection is told to rejoin
            stub.Heartbeat(pb.HeartbeatRequest(learner_id="a", generation=a.generation + 1),
                           timeout=20)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "must rejoin" in e.value.details()
        a.close(), b.close()


def test_round_of_zero_token_pushes_merges_uniformly(toy_layout, tmp_state):
    """Pushes that all carry 0 loss tokens are merged with equal weights (the islands did
    work; their tokens were not counted); next to a counted push they weigh nothing."""
    init = np.zeros(toy_layout.numel, np.float32)
    one = np.ones(toy_layout.numel, np.float32)
    with running_syncer(quorum=2, state_dir=tmp_state, **AVERAGING) as (run, addr):
        a, b = join_all(addr, toy_layout, ["a", "b"], init)
        a.wait_one(timeout=20), b.wait_one(timeout=20)
        assert push_delta(a, one, 0, base=0, seq=0).accepted
        assert push_delta(b, 3 * one, 0, base=0, seq=0).accepted
        np.testing.assert_array_equal(wait_version(a, 1).theta, init - 2 * one)
        assert push_delta(a, one, 0, base=1, seq=1).accepted
        assert push_delta(b, 3 * one, 50, base=1, seq=1).accepted
        np.testing.assert_array_equal(wait_version(a, 2).theta, init - 2 * one - 3 * one)
        a.close(), b.close()
    merges = [r for r in read_tape(tmp_state / "tape.jsonl") if r["event"] == "merge"]
    assert [r["uniform_fallback"] for r in merges] == [True, False]
    assert [(x["tokens"], x["weight"], x["share"]) for x in merges[0]["responders"]] == \
        [(0, 1.0, 0.5), (0, 1.0, 0.5)]
    assert [(x["tokens"], x["weight"], x["share"]) for x in merges[1]["responders"]] == \
        [(0, 0.0, 0.0), (50, 50.0, 1.0)]


def test_final_folder_has_weights_and_provenance(toy_layout, rng, tmp_state):
    from safetensors.numpy import load_file

    init = rng.standard_normal(toy_layout.numel).astype(np.float32)
    with running_syncer(quorum=1, rounds=2, state_dir=tmp_state) as (run, addr):
        c = make_client(addr, "a", toy_layout, export_files={"adapter_config.json": "{}"})
        c.start(init)
        c.wait_one(timeout=20)
        for r in range(2):
            push_delta(c, rng.standard_normal(toy_layout.numel).astype(np.float32), 5, r, r)
        got = wait_version(c, 2)
        assert got.final
        c.close()
    final = tmp_state / "final"
    weights = load_file(final / "weights.safetensors")
    flat = toy_layout.flatten(weights)
    assert flat.tobytes() == got.theta.tobytes()
    assert (final / "adapter_config.json").read_text() == "{}"
    prov = json.loads((final / "provenance.json").read_text())
    assert prov["format"] == 1 and prov["yeto"]["version"] and prov["yeto"]["code_digest"]
    assert prov["config"]["quorum"] == 1 and prov["config"]["outer_lr"] == 0.4
    assert prov["config"]["state_dir"] == str(tmp_state)
    s = prov["syncer"]
    assert (s["version"], s["run_id"], s["weights_file"]) == (2, run.run_id, "weights.safetensors")
    assert s["theta_sha256"] == hashlib.sha256(flat.tobytes()).hexdigest()
    assert s["fingerprint"] == toy_layout.fingerprint and s["islands"]["a"]["pushes"] == 2
    assert "numpy" in prov["environment"]
    assert sorted(p.name for p in final.iterdir()) == \
        ["adapter_config.json", "provenance.json", "weights.safetensors"]


def test_a_stream_opened_before_the_run_has_a_layout_waits_for_it():
    """An observer that subscribes before any island brought the layout: its stream has
    not sent every final weight (the run has none yet), and asking does not raise."""
    from syncer.broadcast import Subscription
    from syncer.run import Config, Run

    run = Run(Config(quorum=1, fragments=2))
    sub = Subscription(run, "rollout-0", 1)
    assert run.owned() == [] and not sub.all_finals_sent()
