"""How a sharded run deals fragments to shards (`syncer.shards`)."""

import pytest

from syncer.shards import Shard, owners


def test_fragments_are_dealt_by_parameter_count_largest_first():
    # 10 goes to shard 0, 7 and 3 to shard 1 (7 + 3 = 10), then 2 to either: the lower
    assert owners([3, 10, 7, 2], 2) == [1, 0, 1, 0]
    loads = [0, 0, 0, 0]
    numels = [5, 9, 1, 4, 4, 8, 2, 6, 3, 7]
    for f, s in enumerate(owners(numels, 4)):
        loads[s] += numels[f]
    assert max(loads) - min(loads) <= max(numels) and sum(loads) == sum(numels)
    assert owners([4, 4], 1) == [0, 0]


def test_a_shard_is_named_i_of_s_and_needs_a_fragment_each():
    assert Shard.parse("1/3") == Shard(1, 3) and Shard(1, 3).owns([5, 5, 5]) == [1]
    for bad in ("3/2", "2", "a/b", "-1/2", "0/0"):
        with pytest.raises(ValueError, match="--shard takes I/S"):
            Shard.parse(bad)
    with pytest.raises(ValueError, match="raise --fragments"):
        owners([1], 2)
