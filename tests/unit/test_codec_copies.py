"""The syncer's q4 decode without copies (issue 34): a staged push decoded from the
pieces it arrives in, whatever their size; a spilled push's codes read straight into
a scratch; the int8 cast of the codes. Each gives the bits of the plain decode."""

import numpy as np
import pytest

from syncer.merge import MergeAccumulator
from syncer.staging import StagedSum
from yeto import codec
from yeto.codec import chunked
from yeto.codec.buffers import SpilledPayload
from yeto.codec.receiver import PayloadReceiver

N = 3 * codec.CHUNK + 1000


def test_q4_decodes_every_code_to_code_minus_8_times_its_scale():
    """A known answer, not a comparison with another decoder: the 16 codes of a block,
    with a scale whose products with −8..7 round."""
    scale = np.float32(0.1)
    codes = np.arange(16, dtype=np.uint8)
    pairs = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)  # low nibble first
    block = np.tile(pairs, 4)  # 64 values: codes 0..15, four times
    payload = np.array([scale], np.float32).tobytes() + block.tobytes()
    got = codec.decode(payload, "q4", 64)
    want = (np.tile(np.arange(16), 4) - 8).astype(np.float32) * scale
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("piece", [999, codec.CHUNK // 2, 3 * codec.CHUNK])
def test_a_staged_push_in_pieces_of_any_size_sums_the_bits_of_a_whole_one(piece, tmp_path):
    """Pieces smaller than a chunk's codes (gathered), exactly one chunk's codes (each
    decoded where it lies: the scales make every later piece start mid-chunk), and
    larger than the payload's codes (every chunk decoded in place)."""
    rng = np.random.default_rng(piece)
    payload = codec.encode((rng.standard_normal(N) * 1e-3).astype(np.float32), "q4")
    staged_acc, whole_acc = MergeAccumulator(N), MergeAccumulator(N)
    keep = SpilledPayload(len(payload), tmp_path)
    staged = StagedSum(staged_acc, "q4", N, staged_acc.weight_for(7), keep)
    staged_acc.staging = staged
    rx = PayloadReceiver("q4", N, into=staged)
    for lo in range(0, len(payload), piece):
        rx.add(memoryview(payload)[lo:lo + piece])
    rx.finish()
    assert staged_acc.add(staged, "q4", 7) == whole_acc.add(payload, "q4", 7)
    assert staged_acc.summed().tobytes() == whole_acc.summed().tobytes()
    keep.close()


def test_a_spilled_payload_reads_into_a_buffer_as_it_reads_bytes(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 300_000, np.uint8).tobytes()
    spilled = SpilledPayload(len(data), tmp_path)
    spilled.write(data)
    into = np.zeros(100_000, np.uint8)
    for part in (slice(0, 1), slice(12_345, 99_999), slice(200_000, 300_000)):
        got = spilled.read_into(part, into)
        assert got.tobytes() == spilled.read(part) == data[part]
    with pytest.raises(codec.CodecError, match="ends at byte"):
        spilled.read_into(slice(299_000, 301_000), np.zeros(2_000, np.uint8))
    spilled.close()


def test_the_norm_and_sum_of_a_spilled_q4_push_are_those_of_the_buffer(tmp_path):
    payload = codec.encode(np.linspace(-1e-3, 1e-3, N, dtype=np.float32), "q4")
    spilled = SpilledPayload(len(payload), tmp_path)
    spilled.write(payload)
    a, b = np.ones(N, np.float32), np.ones(N, np.float32)
    assert chunked.decode_add_norm(spilled, "q4", N, a, 0.3) == \
        chunked.decode_add_norm(payload, "q4", N, b, 0.3)
    assert a.tobytes() == b.tobytes()
    spilled.close()
