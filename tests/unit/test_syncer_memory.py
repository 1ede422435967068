"""The syncer's chunked paths give the same bits as the whole-array computations they
replace, and a bad push leaves the state as it was. (Memory itself is measured by
scripts/bench_memory.py, never asserted here.)

Here: the checks that need no process, server or training (the others:
tests/integration/test_syncer_memory.py)."""


from __future__ import annotations

import json

import numpy as np
import pytest

from syncer import state
from syncer.broadcast import Source
from syncer.merge import MergeAccumulator
from syncer.strategy import Nesterov
from yeto import codec, net, wire
from yeto.codec import buffers, chunked, receiver
from yeto.layout import Layout
from yeto.proto import yeto_pb2 as pb

N = 3 * chunked.CHUNK + 77  # several chunks and a partial last q4 block


ENCODINGS = ("f32", "bf16", "q4")


def _deltas(k: int, n: int = N, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * (i + 1) * 1e-2).astype(np.float32) for i in range(k)]


def _blocked_norm(x: np.ndarray) -> float:
    """The norm the syncer defines: float32 dots over fixed chunks, summed in order in
    float64."""
    x = x.astype(np.float32)
    return float(np.sqrt(sum(float(np.dot(x[lo:hi], x[lo:hi]))
                             for lo, hi in chunked.ranges(0, x.size))))


def _payload_norm(payload, encoding: str) -> float:
    """A push's norm as the syncer defines it: f32 and bf16 by `_blocked_norm` of the
    values; q4 on its codes, Σ over blocks of scale² · Σ (code − 8)² in float64, in
    order, within each chunk (`yeto.codec.kernels`), the chunks' sums added in order."""
    if encoding != "q4":
        return _blocked_norm(codec.decode(payload, encoding, N))
    buf = np.frombuffer(payload, np.uint8)
    nb = -(-N // 64)
    scales = buf[:4 * nb].view(np.float32).astype(np.float64)
    codes = buf[4 * nb:]
    d = (np.stack([codes & 15, codes >> 4], axis=1).reshape(-1).astype(np.int64) - 8)
    d[N:] = 0
    terms = scales * scales * (d * d).reshape(nb, 64).sum(axis=1)
    per = chunked.CHUNK // 64
    return float(np.sqrt(sum(float(np.cumsum(terms[i:i + per])[-1])
                             for i in range(0, nb, per))))


def _whole_array_merge(payloads, encoding: str, tokens: list[int], rule: str) -> np.ndarray:
    """The merge computed on whole decoded arrays (what the syncer did before)."""
    acc = np.zeros(N, np.float32)
    total = norm_sum = 0.0
    for p, t in zip(payloads, tokens):
        w = 1.0 if rule == "uniform" else float(t)
        d = codec.decode(p, encoding, N)
        acc += np.float32(w) * d
        total += w
        norm_sum += w * _payload_norm(p, encoding)
    acc /= total
    if rule == "rda":
        acc *= (norm_sum / total) / _blocked_norm(acc)
    return acc


def _spilled(payload: bytes, encoding: str, tmp_path) -> buffers.SpilledPayload:
    """A payload received as the syncer receives a large push: into a temporary file."""
    rx = receiver.PayloadReceiver(encoding, N, buffers.SpilledPayload(len(payload), tmp_path))
    for piece in net.chunks(payload, 100_003):  # pieces that split floats
        rx.add(piece)
    return rx.finish()


@pytest.mark.parametrize("held", ["memory", "spilled"])
@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("rule", ["mean", "uniform", "rda"])
def test_chunked_merge_equals_the_whole_array_merge(rule, encoding, held, tmp_path):
    payloads = [codec.encode(d, encoding) for d in _deltas(3)]
    tokens = [100, 300, 600]
    acc = MergeAccumulator(N, rule)
    for p, t in zip(payloads, tokens):
        acc.add(p if held == "memory" else _spilled(p, encoding, tmp_path), encoding, t)
    got = acc.result()
    assert got.tobytes() == _whole_array_merge(payloads, encoding, tokens, rule).tobytes()
    assert list(tmp_path.iterdir()) == []  # spilled pushes leave no file behind


def test_a_pooled_spill_file_rewritten_by_a_shorter_push_reads_only_the_new_push(tmp_path):
    pool = buffers.spill_pool(limit=1, directory=tmp_path)
    long_push = codec.encode(_deltas(1, N + 4096, seed=1)[0], "f32")
    first = pool.get(len(long_push))
    first.write(long_push)
    pool.put(first)
    short = codec.encode(_deltas(1, seed=2)[0], "q4")
    rx = receiver.PayloadReceiver("q4", N, pool.get(len(short)))
    for piece in net.chunks(short, 100_003):
        rx.add(piece)
    again = rx.finish()
    assert again is first  # the same file, rewritten from its start
    acc = MergeAccumulator(N, "mean")
    acc.add(again, "q4", 10)
    assert acc.result().tobytes() == _whole_array_merge([short], "q4", [10], "mean").tobytes()
    extra = pool.get(16)  # the pool's file is in use: a new one
    assert extra is not again
    pool.put(again)
    pool.put(extra)  # over the limit of one: the oldest is closed
    assert again.file.closed and not extra.file.closed


def test_a_buffer_pool_serves_each_size_from_its_own_buffers():
    pool = buffers.buffer_pool(limit=2)
    a, b = pool.get(8), pool.get(16)
    pool.put(a)
    pool.put(b)
    assert pool.get(16) is b and pool.get(8) is a and pool.get(8) is not a


@pytest.mark.parametrize("rule", ["mean", "uniform", "rda"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_fused_chunked_commit_equals_result_then_whole_step(rule, momentum):
    payloads = [codec.encode(d, "q4") for d in _deltas(3)]
    rng = np.random.default_rng(5)
    theta, m = rng.standard_normal(N).astype(np.float32), rng.standard_normal(N).astype(np.float32)
    outer = Nesterov(0.7, momentum)
    accs = [MergeAccumulator(N, rule) for _ in range(2)]
    for acc in accs:
        for p, t in zip(payloads, [5, 0, 9]):
            acc.add(p, "q4", t)
    t1, m1 = theta.copy(), m.copy()
    outer.step(t1, m1 if momentum else None, accs[0].result())
    t2, m2 = theta.copy(), m.copy()
    accs[1].step_outer(outer, t2, m2 if momentum else None)
    assert t1.tobytes() == t2.tobytes() and m1.tobytes() == m2.tobytes()


@pytest.mark.parametrize("rule", ["mean", "uniform", "rda"])
@pytest.mark.parametrize("clip_factor", [0.0, 1.0])
@pytest.mark.parametrize("tokens", [[5, 0, 9], [0, 7, 0], [0, 0, 0]])
def test_a_reused_sum_buffer_is_never_read_and_gives_the_bits_of_zeros(rule, clip_factor,
                                                                       tokens):
    """A round's accumulator reuses the last round's buffer unzeroed (the first push
    writes instead of adding): with NaN in it the commit is still the bits of a sum
    started from zeros, whatever the rule, clipping and zero-token order."""
    payloads = [codec.encode(d, "q4") for d in _deltas(3)]
    theta = np.random.default_rng(5).standard_normal(N).astype(np.float32)
    outer, results = Nesterov(0.7, 0.0), []
    for reused in (False, True):
        acc = MergeAccumulator(N, rule, clip_factor)
        if reused:
            acc.reuse(np.full(N, np.nan, np.float32))
        for p, t in zip(payloads, tokens):
            acc.add(p, "q4", t)
        t1 = theta.copy()
        acc.step_outer(outer, t1, None)
        results.append(t1.tobytes())
    assert np.isfinite(np.frombuffer(results[1], np.float32)).all()
    assert results[0] == results[1]


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_decode_assign_is_adding_into_zeros_even_for_negative_zero(encoding):
    d = _deltas(1)[0]
    d[:8] = -0.0  # 0 + -0 is +0: assigning must give the same
    p = codec.encode(d, encoding)
    added, assigned = np.zeros(N, np.float32), np.full(N, np.nan, np.float32)
    codec.decode_add(p, encoding, N, added, 0.3)
    chunked.decode_add(p, encoding, N, assigned, 0.3, assign=True)
    assert added.tobytes() == assigned.tobytes()
    if encoding != "q4":  # q4 keeps no sign of zero to test
        assert np.signbit(codec.decode(p, encoding, N)[:8]).all()


def test_decode_add_equals_codec_and_norm_matches_numpy():
    for encoding in ENCODINGS:
        d = _deltas(1)[0]
        p = codec.encode(d, encoding)
        a, b, c = (np.ones(N, np.float32) for _ in range(3))
        norm = chunked.decode_add_norm(p, encoding, N, a, 0.3)
        codec.decode_add(p, encoding, N, b, 0.3)
        chunked.decode_add(p, encoding, N, c, 0.3)
        assert a.tobytes() == b.tobytes() == c.tobytes()
        whole = codec.decode(p, encoding, N)
        assert norm == _payload_norm(p, encoding) == chunked.norm(p, encoding, N)
        assert norm == pytest.approx(float(np.linalg.norm(whole.astype(np.float64))), rel=1e-4)


@pytest.mark.parametrize("held", ["memory", "spilled"])
def test_clipped_merge_keeps_pushes_compressed_and_equals_whole_arrays(held, tmp_path):
    payloads = [codec.encode(d, "q4") for d in _deltas(3)]
    acc = MergeAccumulator(N, "mean", clip_factor=1.0)
    for p in payloads:
        acc.add(p if held == "memory" else _spilled(p, "q4", tmp_path), "q4", 10)
    kind = bytes if held == "memory" else buffers.SpilledPayload
    assert all(isinstance(dp.payload, kind) for dp in acc.deferred)  # as received
    got = acc.result()
    norms = [_payload_norm(p, "q4") for p in payloads]
    limit = float(np.median(norms))
    want = np.zeros(N, np.float32)
    for p, nrm in zip(payloads, norms):
        want += np.float32(10 * min(1.0, limit / nrm)) * codec.decode(p, "q4", N)
    want /= 30.0
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_outer_step_by_chunks_equals_the_whole_array_step(momentum):
    rng = np.random.default_rng(1)
    theta, m, g = (rng.standard_normal(N).astype(np.float32) for _ in range(3))
    outer = Nesterov(0.7, momentum)
    t1, m1, g1 = theta.copy(), m.copy(), g.copy()
    outer.step(t1, m1 if momentum else None, g1)
    t2, m2, g2 = theta.copy(), m.copy(), g.copy()
    for lo, hi in chunked.ranges(0, N, 1000):
        outer.step(t2[lo:hi], m2[lo:hi] if momentum else None, g2[lo:hi])
    assert t1.tobytes() == t2.tobytes() and m1.tobytes() == m2.tobytes()
    if momentum:  # the documented math, on whole arrays
        mm = np.float32(momentum) * m + g
        want = theta - np.float32(0.7) * g
        want -= np.float32(0.7 * momentum) * mm
        assert t1.tobytes() == want.tobytes() and m1.tobytes() == mm.tobytes()
    else:
        assert t1.tobytes() == (theta - np.float32(0.7) * g).tobytes()


@pytest.mark.parametrize("encoding", ["q4", "bf16"])
def test_compressed_broadcast_encoded_by_chunks_equals_the_whole_encode(encoding):
    rng = np.random.default_rng(2)
    theta = rng.standard_normal(N).astype(np.float32)
    held = theta + rng.standard_normal(N).astype(np.float32) * 1e-2
    whole = codec.encode(theta - held, encoding)
    want_held = held.copy()
    codec.decode_add(whole, encoding, N, want_held, 1.0)
    got = chunked.encode_diff(theta, held, encoding)
    assert got.tobytes() == whole and held.tobytes() == want_held.tobytes()


def test_broadcast_source_keeps_its_version_for_streams_in_progress():
    live = np.arange(1000, dtype=np.float32)
    before = live.tobytes()
    src = Source(live)
    idle = Source(live)
    reader = src.open()
    first = src.read(reader, 0, 1000)
    assert idle.detach() == 0  # nobody reading: nothing copied
    assert src.detach() == 4000 - 1000  # only what the reader has not sent yet
    live += 1  # the commit changes the weights
    rest = src.read(reader, 1000, 4000, prefix=b"p")
    assert first + rest[1:] == before and rest[:1] == b"p"
    src.close(reader)
    later = Source(live)
    assert later.read(later.open(), 0, 4000) == live.tobytes()  # a live source is a view


def test_broadcast_source_builds_a_chunk_once_for_readers_in_step():
    live = np.arange(1000, dtype=np.float32)
    src = Source(live)
    a, b = src.open(), src.open()
    first = src.read(a, 0, 400, prefix=b"h")
    assert src.read(b, 0, 400, prefix=b"h") is first  # the same object: no second copy
    assert src.read(b, 0, 400, prefix=b"x") == b"x" + live.tobytes()[:400]  # its own header
    # both readers passed the chunk: the next read of it builds it anew
    again = src.read(b, 0, 400, prefix=b"h")
    assert again is not first and again == first
    # a reads SHARED + 1 chunks ahead of b: only the last SHARED are kept for b
    got = [src.read(a, lo, lo + 400) for lo in range(400, 400 * (Source.SHARED + 2), 400)]
    behind = src.read(b, 400, 800)
    assert behind is not got[0] and behind == got[0]  # the oldest went: rebuilt
    assert src.read(b, 800, 1200) is got[1]  # the next is still there
    assert src.detach() > 0
    live += 1  # the commit changes the weights: b still streams its version
    assert src.read(b, 1200, 1600) == np.arange(1000, dtype=np.float32).tobytes()[1200:1600]
    solo = Source(live)
    r = solo.open()
    chunk = solo.read(r, 0, 400)
    assert solo.read(r, 0, 400) is not chunk  # one reader: nothing is kept


def test_state_streams_to_a_safetensors_file_that_safe_open_loads(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    rng = np.random.default_rng(3)
    theta, m, island = (rng.standard_normal(N).astype(np.float32) for _ in range(3))
    state.save(tmp_path, theta, m, island, dict(run_id="r", version=2))
    t2, m2, i2, meta = state.load(tmp_path)
    assert (t2.tobytes(), m2.tobytes(), i2.tobytes()) == (theta.tobytes(), m.tobytes(),
                                                          island.tobytes())
    assert t2.flags.writeable and meta["version"] == 2
    path = str(tmp_path / state.STATE_FILE)
    with safe_open(path, framework="np") as f:
        assert sorted(f.keys()) == ["island_theta", "momentum", "theta"]
        assert f.get_tensor("theta").tobytes() == theta.tobytes()
        assert json.loads(f.metadata()["yeto_state"])["theta_sha256"] == state.digest(theta)
    state.save(tmp_path, theta, None, None, dict(run_id="r", version=3))  # momentum 0
    assert sorted(load_file(path)) == ["theta"]
    t3, m3, i3, _ = state.load(tmp_path)
    assert t3.tobytes() == theta.tobytes() and m3 is None and i3 is None


def test_final_weights_stream_to_safetensors_with_shapes(tmp_path):
    from safetensors.numpy import load_file

    layout = Layout.from_shapes({"a.weight": (3, 5), "b.weight": (7,), "c.bias": (2, 2, 2)})
    flat = np.arange(layout.numel, dtype=np.float32)
    tensors = layout.unflatten(flat)
    with open(tmp_path / "w.safetensors", "wb") as f:
        state.write_safetensors(f, tensors, {"format": "pt"})
    got = load_file(str(tmp_path / "w.safetensors"))
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in tensors.items()}
    assert all(np.array_equal(got[k], v) for k, v in tensors.items())
    back, meta = state.read_safetensors(tmp_path / "w.safetensors")
    assert meta == {"format": "pt"} and all(np.array_equal(back[k], v)
                                            for k, v in tensors.items())


def test_push_chunks_parse_as_protobuf_does_and_broadcast_chunks_are_valid_protobuf():
    h = pb.PushHeader(learner_id="a", generation=7, numel=5, payload_bytes=20, seq=3)
    for msg in (pb.PushChunk(header=h, data=b"x" * 300), pb.PushChunk(data=b"abc"),
                pb.PushChunk(), pb.PushChunk(header=h)):
        got = wire.parse_push_chunk(msg.SerializeToString())
        assert got.header == (msg.header if msg.HasField("header") else None)
        assert bytes(got.data) == msg.data
    bh = pb.BroadcastHeader(version=3, numel=7, payload_bytes=28)
    for header, data in ((bh, b"q" * 28), (None, b"z" * 200_000), (bh, b"")):
        raw = wire.chunk_bytes(header, data)
        parsed = pb.BroadcastChunk.FromString(raw)
        assert parsed.data == data and parsed.HasField("header") == (header is not None)
        ours = wire.parse_chunk(raw, pb.BroadcastHeader)
        assert bytes(ours.data) == data and ours.header == (header if header else None)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_receiver_refuses_bad_bytes_as_they_arrive(encoding, tmp_path):
    good = codec.encode(_deltas(1)[0], encoding)
    rx = receiver.PayloadReceiver(encoding, N)
    for piece in net.chunks(good, 100_000):
        rx.add(piece)
    assert rx.finish().tobytes() == good
    assert _spilled(good, encoding, tmp_path).read(slice(0, len(good))) == good
    bad = bytearray(good)
    nb = -(-N // codec.Q4_BLOCK)
    at = 4 * 5 if encoding == "q4" else len(good) // 2 // 4 * 4  # a scale, or a value
    bad[at:at + 4] = np.array([np.nan], np.float32).tobytes()[:4] if encoding != "bf16" \
        else b"\xc0\x7f\xc0\x7f"
    rx = receiver.PayloadReceiver(encoding, N)
    with pytest.raises(codec.CodecError):
        for piece in net.chunks(bytes(bad), 4096):
            rx.add(piece)
    refused_at = rx.n
    assert refused_at < len(good)  # before the whole push was held
    if encoding == "q4":
        assert refused_at <= 4 * nb + 4096  # as soon as the scales were in
    with pytest.raises(ValueError):
        receiver.PayloadReceiver(encoding, N).finish()  # short
