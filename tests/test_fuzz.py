"""Property-based fuzzing of payload decoding and push validation (hypothesis).

The default run tries a few hundred cases per property; `pytest -m slow` runs
10,000. Every case must end in a clean refusal (CodecError / Reject) or a valid
result, and a refused push must leave the run's state digest unchanged.
"""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    run = Run(Config(quorum=1))
    gen = run.join("a", LAYOUT.specs, LAYOUT.fingerprint, "numpy", "w.safetensors", {})[
        "generation"]
    seed = pb.PushHeader(learner_id="a", generation=gen, kind=pb.SEED, encoding="f32",
                         numel=LAYOUT.numel, payload_bytes=4 * LAYOUT.numel)
    run.check_push_header(seed)
    run.push(seed, codec.encode(np.zeros(LAYOUT.numel, np.float32), "f32"))
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


def _push_property(run, gen, fields, payload, use_real_generation, exact_size):
    fields = dict(fields)
    if use_real_generation:
        fields["generation"] = gen
    if exact_size and fields["encoding"] in codec.ENCODINGS:
        fields["payload_bytes"] = codec.encoded_size(fields["encoding"], fields["numel"])
        payload = (payload * (fields["payload_bytes"] // max(len(payload), 1) + 1))[
            :fields["payload_bytes"]]
    h = pb.PushHeader(**fields)
    before = run.state_digest()
    try:
        size = run.check_push_header(h)
        if len(payload) != size:
            raise Reject("invalid", "size")  # what the service does on a short stream
        run.push(h, payload)
    except Reject as e:
        assert str(e)
        assert run.state_digest() == before


def _fuzz(examples):
    run, gen = _started_run()

    @settings(max_examples=examples, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(encoding=st.sampled_from(codec.ENCODINGS), numel=st.integers(0, 300),
           payload=st.binary(max_size=1300), fields=headers, real_gen=st.booleans(),
           exact=st.booleans())
    def prop(encoding, numel, payload, fields, real_gen, exact):
        _decodes_cleanly(encoding, numel, payload)
        _push_property(run, gen, fields, payload, real_gen, exact)

    prop()


def test_fuzz_decoding_and_validation():
    _fuzz(FAST)


@pytest.mark.slow
def test_fuzz_decoding_and_validation_10k():
    _fuzz(10_000)
