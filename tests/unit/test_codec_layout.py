"""Layout, fingerprint, codec round trips and error feedback."""

import itertools

import numpy as np
import pytest

from yeto import codec
from yeto.layout import Layout, LayoutMismatch, TensorSpec, fingerprint


def test_layout_is_canonical_and_deterministic():
    shapes = {"m.layers.10.w": (3, 2), "m.layers.2.w": (4,), "m.layers.2.b": (5, 5), "emb": (7,)}
    a = Layout.from_shapes(shapes, num_fragments=2)
    b = Layout.from_shapes(dict(reversed(list(shapes.items()))), num_fragments=2)
    assert [s.name for s in a.specs] == ["emb", "m.layers.2.b", "m.layers.2.w", "m.layers.10.w"]
    assert a.fingerprint == b.fingerprint and a.fragments == b.fragments
    # the fingerprint is a plain SHA-256 of a text rendering: pinned here so any
    # change to it (which would split fleets running different versions) is noticed
    assert fingerprint([TensorSpec("x", (2, 3))]) == \
        "f8a1f12e0712e89671b80ba4dc27f445ef637af652e530634398368bce99e895"
    flat = np.arange(a.numel, dtype=np.float32)
    back = a.flatten(a.unflatten(flat))
    np.testing.assert_array_equal(back, flat)


@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_fragments_cover_whole_tensors_contiguously(parts):
    shapes = {f"layers.{i}.w": (i + 1, 8) for i in range(7)}
    lay = Layout.from_shapes(shapes, num_fragments=parts)
    assert len(lay.fragments) == parts
    assert lay.fragments[0].start == 0 and lay.fragments[-1].stop == lay.numel
    for f, g in zip(lay.fragments, lay.fragments[1:]):
        assert f.stop == g.start
    assert sum(len(f.tensors) for f in lay.fragments) == 7


def test_mismatch_names_first_differing_tensor():
    a = Layout.from_shapes({"l.0.A": (4, 8), "l.0.B": (8, 4)})
    b = Layout.from_shapes({"l.0.A": (4, 8), "l.0.B": (8, 2)})
    with pytest.raises(LayoutMismatch, match=r"l\.0\.B \[8, 4\].*l\.0\.B \[8, 2\]"):
        a.check_same(b)


@pytest.mark.parametrize("enc", codec.ENCODINGS)
@pytest.mark.parametrize("n", [1, 63, 64, 65, 200_003])
def test_round_trip(enc, n):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32) * 5
    p = codec.encode(x, enc)
    assert len(p) == codec.encoded_size(enc, n)
    y = codec.decode(p, enc, n)
    if enc == "f32":
        np.testing.assert_array_equal(x, y)
    elif enc == "bf16":
        np.testing.assert_allclose(y, x, rtol=2 ** -8)
    else:
        assert (np.abs(x - y) <= codec.q4_error_bound(x)).all()
    acc = np.ones(n, np.float32)
    codec.decode_add(p, enc, n, acc, 2.0)
    np.testing.assert_allclose(acc, 1 + 2 * y, rtol=1e-6, atol=1e-6)


def test_q4_bit_format_is_as_documented():
    x = np.zeros(64, np.float32)
    x[0], x[1], x[2] = 7.0, -7.0, 3.4
    p = codec.encode(x, "q4")
    assert np.frombuffer(p[:4], np.float32)[0] == 1.0  # scale = max|x| / 7
    # element 0 -> code 15 (low nibble), element 1 -> code 1 (high nibble)
    assert p[4] == 15 | (1 << 4)
    assert p[5] == (3 + 8) | (8 << 4)  # 3.4 rounds to 3; zero is code 8
    assert len(p) == 4 + 32


@pytest.mark.parametrize("enc", ["f32", "bf16"])
def test_received_plain_payloads_are_checked_finite_value_by_value(enc):
    """`validate` and `decode` refuse NaN and ±inf wherever they sit (the first, a middle
    and the last value of a chunk and of the payload), among huge finite values or
    zeros, and accept the huge finite values themselves."""
    n = 2 * codec.CHUNK + 77
    huge = np.full(n, 3e38, np.float32)
    huge[1::2] = -3e38
    for ok in (huge, np.zeros(n, np.float32)):
        payload = codec.encode(ok, enc)
        codec.validate(payload, enc, n)
        assert np.isfinite(codec.decode(payload, enc, n)).all()
    width = 4 if enc == "f32" else 2  # bf16 keeps the top half of each float32
    for base, bad, at in itertools.product((huge, np.zeros(n, np.float32)),
                                           (np.nan, np.inf, -np.inf),
                                           (0, codec.CHUNK - 1, codec.CHUNK + 5, n - 1)):
        raw = bytearray(codec.encode(base, enc))
        one = np.array([bad], np.float32).view(np.uint32) >> (0 if enc == "f32" else 16)
        raw[at * width:(at + 1) * width] = one.astype(f"<u{width}").tobytes()
        for check in (codec.validate, codec.decode):
            with pytest.raises(codec.CodecError, match="non-finite"):
                check(bytes(raw), enc, n)


def test_zero_block_and_nonfinite_refused():
    np.testing.assert_array_equal(codec.decode(codec.encode(np.zeros(100, np.float32), "q4"),
                                               "q4", 100), np.zeros(100))
    for enc in codec.ENCODINGS:
        with pytest.raises(codec.CodecError, match="non-finite"):
            codec.encode(np.array([1.0, np.inf], np.float32), enc)
    with pytest.raises(codec.CodecError, match="must be"):
        codec.decode(b"\0" * 10, "q4", 64)
    bad = bytearray(codec.encode(np.ones(64, np.float32), "q4"))
    bad[:4] = np.array([np.nan], np.float32).tobytes()
    with pytest.raises(codec.CodecError, match="scales"):
        codec.validate(bytes(bad), "q4", 64)


def test_error_feedback_tracks_running_sum_over_100_pushes():
    rng = np.random.default_rng(1)
    n = 10_000
    ef = codec.ErrorFeedback(n, "q4")
    true_sum = np.zeros(n, np.float64)
    sent_sum = np.zeros(n, np.float64)
    steps = []
    for _ in range(100):
        x = rng.standard_normal(n).astype(np.float32) * 0.01
        target = ef.residual + x
        steps.append(codec.q4_error_bound(target) * 2)  # one quantization step per block
        true_sum += x
        sent_sum += codec.decode(ef.encode(x), "q4", n)
    # the gap is exactly the current residual: within half of the last step
    assert (np.abs(true_sum - sent_sum) <= steps[-1] + 1e-6).all()


def test_without_feedback_the_error_accumulates():
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal(5000).astype(np.float32) * 0.01 for _ in range(100)]
    ef = codec.ErrorFeedback(5000, "q4")
    with_fb = sum(codec.decode(ef.encode(x), "q4", 5000).astype(np.float64) for x in xs)
    without = sum(codec.decode(codec.encode(x, "q4"), "q4", 5000).astype(np.float64) for x in xs)
    truth = sum(x.astype(np.float64) for x in xs)
    assert np.abs(without - truth).mean() > 3 * np.abs(with_fb - truth).mean()


def test_q4_coding_on_many_threads_at_once_equals_one_at_a_time():
    """Threads coding at once each take their own spare scratch: the bytes and sums
    are those of the same calls made one after another."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(3 * codec.CHUNK + 70).astype(np.float32) for _ in range(6)]

    def work(x):
        payload = codec.encode(x, "q4")
        acc = np.ones_like(x)
        codec.decode_add(payload, "q4", x.size, acc, 0.5)
        return payload, acc.tobytes()

    want = [work(x) for x in xs]
    with ThreadPoolExecutor(6) as pool:
        for _ in range(3):
            assert list(pool.map(work, xs)) == want


def test_error_feedback_takes_the_encodes_own_decoded_values_bit_for_bit():
    """With a scratch, the residual comes from the encode's own arithmetic, not from
    decoding the codes again: the same payload and residual bits as without one,
    also for blocks of zeros, blocks whose 1 / scale overflows, and a padded tail."""
    n = codec.CHUNK - 40
    rng = np.random.default_rng(3)
    x = rng.standard_normal(n).astype(np.float32)
    x[:64] = 0.0
    x[64:128] = 1e-39  # a subnormal scale: 1 / scale is inf
    x[128:192] = rng.standard_normal(64).astype(np.float32) * 1e-37
    start = (rng.standard_normal(n) * 0.01).astype(np.float32)
    start[:192] = 0.0  # the residual keeps those blocks as they are
    got = []
    for scratch in (None, codec.Scratch(n)):
        fb, enc = codec.ErrorFeedback(n, "q4"), codec.Encoder("q4", n)
        fb.residual[...] = start
        fb.encode_piece(x.copy(), enc, 0, 0, scratch)
        got.append((enc.buffer.tobytes(), fb.residual.tobytes()))
    assert got[0] == got[1]
    assert np.abs(np.frombuffer(got[1][1], np.float32)).max() > 0  # a residual was kept
