"""A run served by several syncers, each the owner of some fragments (`--shard I/S`).

Every shard knows the whole layout and holds all of Θ, seeded alike, but only its own
fragments' rounds open there: it takes pushes to them, steps them, saves them and
broadcasts them. Islands push each fragment to its owner and subscribe to every shard
(`yeto.client.sharded.ShardedClient`). Fragments are dealt to shards by parameter
count, so each shard moves about 1/S of the bytes; the deal depends only on the layout
and S, so every shard and island computes the same map."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    """This syncer's place: shard `index` of `count` (count 1: an unsharded run)."""

    index: int = 0
    count: int = 1

    @classmethod
    def parse(cls, text: str) -> Shard:
        """'I/S' (0 <= I < S), e.g. '0/2'."""
        index, sep, count = text.partition("/")
        try:
            shard = cls(int(index), int(count))
        except ValueError:
            shard = None
        if not sep or shard is None or not 0 <= shard.index < shard.count:
            raise ValueError(f"--shard takes I/S with 0 <= I < S (this syncer's index and the "
                             f"number of shards), e.g. --shard 0/2; got {text!r}")
        return shard

    def owners(self, numels: list[int]) -> list[int]:
        """The shard owning each fragment (`numels[f]` values in fragment f)."""
        return owners(numels, self.count)

    def owns(self, numels: list[int]) -> list[int]:
        """The fragments this shard owns."""
        return [f for f, o in enumerate(self.owners(numels)) if o == self.index]


def owners(numels: list[int], count: int) -> list[int]:
    """Deal fragments to `count` shards by parameter count: largest first, each to the
    shard holding the fewest values so far (ties: the lower index)."""
    if count < 1:
        raise ValueError("a run has at least one shard")
    if len(numels) < count:
        raise ValueError(f"{count} shards need at least {count} fragments; the run has "
                         f"{len(numels)} (raise --fragments)")
    load, out = [0] * count, [0] * len(numels)
    for f in sorted(range(len(numels)), key=lambda f: (-numels[f], f)):
        s = min(range(count), key=lambda s: (load[s], s))
        out[f], load[s] = s, load[s] + numels[f]
    return out
