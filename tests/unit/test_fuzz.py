"""Property-based fuzzing of payload decoding and push validation (hypothesis).

The default run tries a few hundred cases per property; `pytest -m slow` runs
10,000. Every case must end in a clean refusal (CodecError / Reject) or a valid
result, and a refused push must leave the run's state digest unchanged. Half the
pushes are valid for the open round (right learner, generation, round, version, seq,
sizes; finite values): each must be accepted and move Θ by exactly its payload. The
test prints how many pushes of each kind were tried, and fails unless both the
accepted and the refused branch were reached.
"""

import os
from collections import Counter

import numpy as np
import pytest
from helpers.streams import Stream
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from syncer.bounds import Bounds
from syncer.messages import PushHeader
from syncer.run import Config, Reject, Run
from yeto import codec
from yeto.layout import Layout
from yeto.proto import yeto_pb2 as pb

FAST = int(os.environ.get("YETO_FUZZ_EXAMPLES", "300"))
LAYOUT = Layout.from_shapes({"f.layers.0.lora_A.weight": (4, 8),
                             "f.layers.0.lora_B.weight": (8, 4)})


def _decodes_cleanly(encoding, numel, payload):
    try:
        out = codec.decode(payload, encoding, numel)
    except codec.CodecError:
        return
    assert out.shape == (numel,) and np.isfinite(out).all()


def _started_run() -> tuple[Run, int]:
    # plain averaging and no norm bound: a valid push moves Θ by exactly its values
    run = Run(Config(quorum=1, bounds=Bounds(norm_factor=0), outer="nesterov", outer_lr=1.0,
                     outer_momentum=0.0))
    gen = run.join("a", LAYOUT.specs, LAYOUT.fingerprint, "numpy", "w.safetensors", {})[
        "generation"]
    seed = PushHeader.from_pb(pb.PushHeader(learner_id="a", generation=gen, kind=pb.SEED,
                                            encoding="f32", numel=LAYOUT.numel,
                                            payload_bytes=4 * LAYOUT.numel))
    run.push(seed, Stream(codec.encode(np.zeros(LAYOUT.numel, np.float32), "f32")))
    assert run.started
    return run, gen


headers = st.fixed_dictionaries({
    "learner_id": st.one_of(st.just("a"), st.text(max_size=20)),
    "generation": st.integers(0, 2 ** 64 - 1),
    "round": st.integers(0, 5),
    "fragment": st.integers(0, 3),
    "base_version": st.integers(0, 5),
    "loss_tokens": st.integers(0, 2 ** 40),
    "steps": st.integers(0, 100),
    "encoding": st.sampled_from(["f32", "bf16", "q4", "q8", ""]),
    "numel": st.one_of(st.just(LAYOUT.numel), st.integers(0, 200)),
    "payload_bytes": st.integers(0, 400),
    "kind": st.integers(0, 1),
    "seq": st.integers(0, 3),
})


def _push_property(run, gen, fields, payload, use_real_generation, exact_size) -> str:
    """A push from random fields: refused cleanly with the state unchanged, or taken.
    Returns what happened: "accepted", "duplicate" or "refused"."""
    fields = dict(fields)
    if use_real_generation:
        fields["generation"] = gen
    if exact_size and fields["encoding"] in codec.ENCODINGS:
        fields["payload_bytes"] = codec.encoded_size(fields["encoding"], fields["numel"])
        payload = (payload * (fields["payload_bytes"] // max(len(payload), 1) + 1))[
            :fields["payload_bytes"]]
    h = PushHeader.from_pb(pb.PushHeader(**fields))
    before = run.state_digest()
    try:  # a stream of another size than its header's fails in the receiver
        return run.push(h, Stream(payload))["status"]
    except (Reject, ValueError, codec.CodecError) as e:  # the service: Reject "invalid"
        assert str(e)
        assert run.state_digest() == before
        return "refused"


def _valid_push(run, gen, seq, encoding, delta, loss_tokens, steps) -> str:
    """A push that is valid for the run's open round: it is accepted, commits (quorum
    1) and moves Θ by exactly the decoded payload (outer lr 1, momentum 0)."""
    payload = codec.encode(delta, encoding)
    version, theta = run.version, run.theta.copy()
    h = PushHeader.from_pb(pb.PushHeader(
        learner_id="a", generation=gen, round=version + 1, fragment=0, base_version=version,
        loss_tokens=loss_tokens, steps=steps, encoding=encoding, numel=LAYOUT.numel,
        payload_bytes=len(payload), kind=pb.DELTA, seq=seq))
    reply = run.push(h, Stream(payload))
    assert reply["accepted"] and reply["status"] == "accepted", reply
    assert run.version == version + 1
    want = theta - codec.decode(payload, encoding, LAYOUT.numel)
    np.testing.assert_allclose(run.theta, want, rtol=1e-5, atol=1e-5)
    return "accepted"


deltas = hnp.arrays(np.float32, LAYOUT.numel,
                    elements=st.floats(-100, 100, allow_nan=False, width=32))


def _fuzz(examples) -> Counter:
    run, gen = _started_run()
    tried = Counter()
    seq = [-1]  # the newest seq the run took from "a"

    @settings(max_examples=examples, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(encoding=st.sampled_from(codec.ENCODINGS), numel=st.integers(0, 300),
           payload=st.binary(max_size=1300), fields=headers, real_gen=st.booleans(),
           exact=st.booleans(), valid=st.booleans(), delta=deltas,
           loss_tokens=st.integers(1, 2 ** 20), steps=st.integers(1, 100))
    def prop(encoding, numel, payload, fields, real_gen, exact, valid, delta, loss_tokens,
             steps):
        _decodes_cleanly(encoding, numel, payload)
        if valid:
            what = _valid_push(run, gen, seq[0] + 1, encoding, delta, loss_tokens, steps)
            seq[0] += 1
        else:
            what = _push_property(run, gen, fields, payload, real_gen, exact)
            if what == "accepted":
                seq[0] = max(seq[0], fields["seq"])
        tried[f"{'valid' if valid else 'random'} {what}"] += 1

    prop()
    return tried


def _report(tried: Counter, record_property) -> None:
    print(f"pushes tried: {dict(sorted(tried.items()))}")
    record_property("pushes_tried", dict(tried))
    accepted = sum(n for k, n in tried.items() if k.endswith("accepted"))
    refused = sum(n for k, n in tried.items() if k.endswith("refused"))
    assert accepted > 0 and refused > 0, tried  # both branches were reached


def test_fuzz_decoding_and_validation(record_property):
    _report(_fuzz(FAST), record_property)


@pytest.mark.slow
def test_fuzz_decoding_and_validation_10k(record_property):
    _report(_fuzz(10_000), record_property)
