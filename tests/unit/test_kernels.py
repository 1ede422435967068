"""The compiled q4 sum (`yeto.codec.kernels`) against its numpy twin and the codec:
the same bits for the sum, the same bits for the norm, whatever the chunk's length."""

import numpy as np
import pytest

from yeto import codec
from yeto.codec import kernels

numba = pytest.importorskip("numba")


def _chunk(n: int, seed: int):
    """A q4 chunk of n values as (scales, codes), the last block's padding codes random
    (a sender may put anything there), and its payload."""
    rng = np.random.default_rng(seed)
    payload = bytearray(codec.encode(rng.standard_normal(n).astype(np.float32), "q4"))
    nb = -(-n // 64)
    payload[4 * nb:] = rng.integers(0, 256, nb * 32, dtype=np.uint8).tobytes()
    buf = np.frombuffer(bytes(payload), np.uint8)
    return buf[:4 * nb].view(np.float32), buf[4 * nb:], bytes(payload)


def _both(scales, codes, n, acc, w, assign):
    """The kernel's and the twin's (result, acc after)."""
    out = []
    for name in ("auto", "numpy"):
        a = None if acc is None else acc.copy()
        with kernels.using(name):
            out.append((kernels.q4_add_square(scales, codes, n, a, np.float32(w), assign), a))
    return out


@pytest.mark.parametrize("n", [64, 1000, 4096 + 3, 1 << 17])
@pytest.mark.parametrize("assign", [False, True])
def test_kernel_and_twin_agree_bit_for_bit_and_sum_as_the_codec_does(n, assign):
    scales, codes, payload = _chunk(n, n)
    acc = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    (sq_k, a_k), (sq_n, a_n) = _both(scales, codes, n, acc, 0.37, assign)
    assert kernels.backend() == "numba"
    assert a_k.tobytes() == a_n.tobytes()
    assert sq_k == sq_n
    want = np.zeros(n, np.float32) if assign else acc.copy()
    codec.decode_add(payload, "q4", n, want, 0.37)
    assert a_k.tobytes() == want.tobytes()
    values = codec.decode(payload, "q4", n).astype(np.float64)
    assert sq_k == pytest.approx(float(values @ values), rel=1e-6)


def test_norm_alone_reads_only_the_first_n_values():
    n = 100  # one whole block and 36 of the next: its padding must not count
    scales, codes, payload = _chunk(n, 7)
    (sq_k, _), (sq_n, _) = _both(scales, codes, n, None, 0.0, False)
    values = codec.decode(payload, "q4", n).astype(np.float64)
    assert sq_k == sq_n == pytest.approx(float(values @ values), rel=1e-6)


def test_negative_zero_assigned_is_positive_as_adding_makes_it():
    scales = np.array([1.0], np.float32)
    codes = np.full(32, 0x88, np.uint8)  # every code 8: value 0
    (_, a_k), (_, a_n) = _both(scales, codes, 64, np.full(64, np.nan, np.float32), -1.0, True)
    assert not np.signbit(a_k).any() and a_k.tobytes() == a_n.tobytes()


def test_a_short_buffer_is_refused():
    scales, codes, _ = _chunk(128, 3)
    with pytest.raises(ValueError, match="needs 2 scales"):
        kernels.q4_add_square(scales[:1], codes, 128, None, np.float32(1), False)


@pytest.mark.parametrize("lr,mu,w,momentum", [(1.0, 0.0, 0.0, False), (0.7, 0.0, 0.0, False),
                                              (0.4, 0.9, 0.9, True), (1.0, 0.5, 0.5, True),
                                              (0.79, 0.32, 0.32, True), (0.4, 0.0, 0.9, True)])
@pytest.mark.parametrize("divisor", [1.0, 3.7, 1000003.0])
def test_outer_step_kernel_and_twin_agree_bit_for_bit(lr, mu, w, momentum, divisor):
    """...and both are numpy's plain formula on x = g / divisor in float32, over more
    than one of the twin's chunks."""
    rng = np.random.default_rng(3)
    n = codec.CHUNK + 5000
    theta0, m0, g0 = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    x = g0 / np.float32(divisor)
    m_ref = m0 * np.float32(mu) + x if momentum else None
    theta_ref = theta0 - x * np.float32(lr) if lr != 1.0 else theta0 - x
    if momentum:
        theta_ref = theta_ref - m_ref * np.float32(lr * w)
    for name in ("auto", "numpy"):
        theta, g = theta0.copy(), g0.copy()
        m = m0.copy() if momentum else None
        with kernels.using(name):
            assert kernels.outer_step(theta, m, g, lr, mu, w, divisor)
        assert theta.tobytes() == theta_ref.tobytes(), name
        assert m is None or m.tobytes() == m_ref.tobytes(), name


def test_outer_step_reports_a_non_finite_result():
    theta = np.array([3e38, 0.0], np.float32)
    g = np.array([-3e38, 1.0], np.float32)
    for name in ("auto", "numpy"):
        with kernels.using(name):
            assert not kernels.outer_step(theta.copy(), None, g.copy(), 1.0, 0.0, 0.0)
            m = np.zeros(2, np.float32)
            assert not kernels.outer_step(np.zeros(2, np.float32), m,
                                          np.array([np.inf, 0], np.float32), 0.5, 0.9, 0.9)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 8, 16, 17])
def test_the_column_median_is_numpy_s_bit_for_bit_compiled_and_not(k):
    """The centre bound's median (syncer.merge.Centre): the kernel, its twin (a sorting
    network) and np.median agree on every bit, ties and a partial last block included."""
    rng = np.random.default_rng(k)
    rows = rng.standard_normal((k, 1000)).astype(np.float32)
    rows[:, :7] = 0.5  # ties
    want = np.median(rows, axis=0).astype(np.float32)
    if k % 2 == 0:  # float32 (a + b) × 0.5, as the module defines it
        s = np.sort(rows, axis=0)
        want = (s[k // 2 - 1] + s[k // 2]) * np.float32(0.5)
    for name in ("auto", "numpy"):
        with kernels.using(name):
            assert np.array_equal(kernels.column_median(rows), want), name
    sorted_rows = rows.copy()
    kernels.sort_columns(sorted_rows)
    assert np.array_equal(sorted_rows, np.sort(rows, axis=0))
