"""The syncer sums a round's first push as it arrives (`syncer.staging`, issue 34):
the round's sum is, bit for bit, the sum of the whole payloads in the order the run
accepted them, and a push broken mid-stream leaves the state as it was.

Here: the accumulator and the run in this process, bytes fed as a stream would bring
them (the same over gRPC: tests/integration/test_faults.py's bad pushes, and every
integration run, stage their rounds' first pushes)."""

import numpy as np
import pytest
from helpers.streams import PIECE, Stream

from syncer.bounds import Bounds
from syncer.merge import MergeAccumulator
from syncer.messages import PushHeader
from syncer.run import Config, Run
from syncer.staging import StagedSum, WholePush
from syncer.strategy import Nesterov
from yeto import codec
from yeto.codec.buffers import SpilledPayload
from yeto.codec.receiver import PayloadReceiver
from yeto.layout import Layout

N = 3 * codec.CHUNK + 1000  # chunks and a tail that is not a whole q4 block


def _payloads(encoding, k=3, seed=0):
    rng = np.random.default_rng(seed)
    return [codec.encode((rng.standard_normal(N) * 1e-3).astype(np.float32), encoding)
            for _ in range(k)]


def _stream(staged, payload, upto=None):
    """Feed `payload` (its first `upto` bytes) into `staged` through a receiver."""
    rx = PayloadReceiver(staged.encoding, staged.numel, into=staged)
    data = memoryview(payload)[:upto]
    for lo in range(0, len(data), PIECE):
        rx.add(data[lo:lo + PIECE])
    return rx


@pytest.mark.parametrize("encoding,keep", [("q4", "array"), ("q4", "spill"),
                                           ("f32", "array"), ("bf16", "spill")])
def test_arrival_order_sum_equals_commit_time_sum_bit_for_bit(encoding, keep, tmp_path):
    """The first push staged as it streams in (its bytes kept in a pooled buffer or a
    spill file), two more whole: the bits of three whole pushes in that order."""
    pushes, tokens = _payloads(encoding), [30, 10, 60]
    staged_acc, whole_acc = MergeAccumulator(N), MergeAccumulator(N)
    size = len(pushes[0])
    kept = np.empty(size, np.uint8) if keep == "array" else SpilledPayload(size, tmp_path)
    staged = StagedSum(staged_acc, encoding, N, staged_acc.weight_for(tokens[0]), kept)
    staged_acc.staging = staged
    _stream(staged, pushes[0]).finish()
    got = [staged_acc.add(staged, encoding, tokens[0])]
    got += [staged_acc.add(p, encoding, t) for p, t in zip(pushes[1:], tokens[1:])]
    want = [whole_acc.add(p, encoding, t) for p, t in zip(pushes, tokens)]
    assert got == want
    assert staged_acc.summed().tobytes() == whole_acc.summed().tobytes()
    assert (staged_acc.count, staged_acc.total_weight, staged_acc.norm_sum) == \
        (whole_acc.count, whole_acc.total_weight, whole_acc.norm_sum)
    thetas = [np.linspace(-1, 1, N, dtype=np.float32) for _ in range(2)]
    for acc, theta in zip((staged_acc, whole_acc), thetas):
        acc.step_outer(Nesterov(0.7, 0.0), theta, None)
    assert thetas[0].tobytes() == thetas[1].tobytes()


def test_a_staged_push_over_the_norm_bound_is_scaled_to_it():
    push = _payloads("q4", 1)[0]
    acc = MergeAccumulator(N)
    staged = StagedSum(acc, "q4", N, 5.0, np.empty(len(push), np.uint8))
    acc.staging = staged
    _stream(staged, push).finish()
    norm = codec.decode(push, "q4", N).astype(np.float64)
    limit = float(np.linalg.norm(norm)) / 4
    added = acc.add(staged, "q4", 5, norm_limit=limit)
    assert added.scale == pytest.approx(0.25, rel=1e-6)
    np.testing.assert_allclose(np.linalg.norm(acc.summed().astype(np.float64)), 5 * limit,
                               rtol=1e-5)


# ---- through the run ----------------------------------------------------------------------
LAYOUT = Layout.from_shapes({"w": (N,)})


def _run(islands=("a", "b", "c")):
    # no share cap, no centre bound: with either, three islands would keep their pushes
    # until the commit, not stage them
    run = Run(Config(quorum=len(islands), grace_ms=0,
                     bounds=Bounds(max_share=1.0, center_factor=0.0)))
    gens = {i: run.join(i, LAYOUT.specs, LAYOUT.fingerprint, "numpy", "w.safetensors",
                        {})["generation"] for i in islands}
    seed = codec.encode(np.linspace(-1, 1, N, dtype=np.float32), "f32")
    run.push(_header("a", gens["a"], seed=True, encoding="f32"), WholePush(seed))
    return run, gens


def _header(learner, gen, seed=False, encoding="q4", tokens=7, seq=0):
    return PushHeader(learner, gen, 0 if seed else 1, 0, 0, 0 if seed else tokens, 1,
                      encoding, N, codec.encoded_size(encoding, N), seed, seq)


def _whole(run, h, payload):
    return run.push(h, WholePush(payload))


def test_a_push_broken_mid_stream_leaves_the_run_unchanged():
    pushes = _payloads("q4", 2, seed=1)
    run, gens = _run(("a", "b"))
    digest = run.state_digest()
    seen = []

    def meanwhile(staged):
        seen.append((isinstance(staged, StagedSum), staged.lo))

    a = Stream(pushes[0], upto=len(pushes[0]) // 2, meanwhile=meanwhile, broken=True)
    with pytest.raises(ValueError, match="payload ended"):
        run.push(_header("a", gens["a"]), a)  # the stream broke off half way
    assert seen[0][0] and seen[0][1] > 0  # chunks were summed into the round as they came
    assert run.state_digest() == digest and run.rounds.open[0].acc.staging is None
    # the same round goes on, and ends as if the broken push had never come
    reference, ref_gens = _run(("a", "b"))
    for r, g in ((run, gens), (reference, ref_gens)):
        for i, (learner, p) in enumerate(zip("ab", pushes)):
            assert _whole(r, _header(learner, g[learner], tokens=7 + i), p)["accepted"]
    assert run.version == reference.version == 1
    assert run.theta.tobytes() == reference.theta.tobytes()


def test_a_whole_push_takes_the_round_from_one_still_arriving():
    """Island a stages (its stream half in), b's push arrives whole and is summed at
    once (nobody waits for a stream), then a's last byte comes: a is summed from its
    own bytes. Θ equals the run that got b then a whole, bit for bit."""
    pushes = _payloads("q4", 3, seed=2)
    run, gens = _run()

    def meanwhile(staged):
        assert isinstance(staged, StagedSum) and not staged.demoted
        assert _whole(run, _header("b", gens["b"], tokens=9), pushes[1])["accepted"]
        assert staged.demoted and run.rounds.open[0].acc.staging is None

    a = Stream(pushes[0], upto=len(pushes[0]) // 2, meanwhile=meanwhile)
    assert run.push(_header("a", gens["a"]), a)["accepted"]
    assert a.into.demoted
    assert _whole(run, _header("c", gens["c"], tokens=11), pushes[2])["accepted"]
    reference, g = _run()
    for learner, p, t in (("b", pushes[1], 9), ("a", pushes[0], 7), ("c", pushes[2], 11)):
        assert _whole(reference, _header(learner, g[learner], tokens=t), p)["accepted"]
    assert run.version == reference.version == 1
    assert run.theta.tobytes() == reference.theta.tobytes()


def test_a_staged_push_refused_at_its_end_changes_nothing():
    push = _payloads("q4", 1, seed=3)[0]
    run, gens = _run(("a", "b"))
    digest = run.state_digest()

    def meanwhile(staged):
        assert isinstance(staged, StagedSum)
        run.finished = True  # the run ended while the push arrived

    with pytest.raises(Exception, match="finished"):
        run.push(_header("a", gens["a"], seq=0), Stream(push, upto=len(push) // 2,
                                                         meanwhile=meanwhile))
    run.finished = False
    assert run.state_digest() == digest and run.rounds.open[0].acc.staging is None


def test_a_push_that_starts_beside_a_stager_not_half_in_takes_it_off_the_buffer():
    """Pushes arriving together race, and a stager that loses throws its decode away:
    a push starting beside a stager that is not half in makes it a whole push at once
    (`Rounds.make_way`). The bits are those of whole pushes in the order the run
    accepts them: here b (it ends first), then a."""
    pushes = _payloads("q4", 2, seed=4)
    run, gens = _run(("a", "b"))
    ha, hb = _header("a", gens["a"]), _header("b", gens["b"], tokens=9)

    def b_starts(staged):
        def a_made_way(_):
            assert staged.demoted and run.rounds.open[0].acc.staging is None

        b = Stream(pushes[1], upto=0, meanwhile=a_made_way, alone=False)
        assert run.push(hb, b)["accepted"] and b.into is not None

    a = Stream(pushes[0], upto=len(pushes[0]) // 4, meanwhile=b_starts)
    assert run.push(ha, a)["accepted"] and a.into.demoted
    reference, g = _run(("a", "b"))
    for learner, p, t in (("b", pushes[1], 9), ("a", pushes[0], 7)):
        assert _whole(reference, _header(learner, g[learner], tokens=t), p)["accepted"]
    assert run.version == reference.version == 1
    assert run.theta.tobytes() == reference.theta.tobytes()


def test_a_stager_past_half_keeps_staging_when_another_push_starts():
    """b starts beside a stager past half in (it keeps staging), then breaks off; a
    ends staged; b comes again whole: the bits of a then b, whole."""
    pushes = _payloads("q4", 2, seed=5)
    run, gens = _run(("a", "b"))
    ha, hb = _header("a", gens["a"]), _header("b", gens["b"], tokens=9)

    def b_starts_and_breaks(staged):
        assert 2 * staged.lo >= staged.numel

        def a_kept_staging(_):
            assert not staged.demoted and run.rounds.open[0].acc.staging is staged

        b = Stream(pushes[1], upto=0, meanwhile=a_kept_staging, broken=True, alone=False)
        with pytest.raises(ValueError, match="payload ended"):
            run.push(hb, b)

    a = Stream(pushes[0], upto=3 * len(pushes[0]) // 4, meanwhile=b_starts_and_breaks)
    assert run.push(ha, a)["accepted"] and not a.into.demoted
    assert _whole(run, hb, pushes[1])["accepted"]
    reference, g = _run(("a", "b"))
    for learner, p, t in (("a", pushes[0], 7), ("b", pushes[1], 9)):
        assert _whole(reference, _header(learner, g[learner], tokens=t), p)["accepted"]
    assert run.version == reference.version == 1
    assert run.theta.tobytes() == reference.theta.tobytes()
