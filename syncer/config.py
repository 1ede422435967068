"""The run's settings (`Config`): the defaults are `python -m syncer`'s, whose flags take
them from here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from syncer import strategy
from syncer.bounds import Bounds
from syncer.shards import Shard
from yeto.client.connection import TLSConfig

MAX_QUORUM = 1 << 20  # islands a round may wait for (the wire carries it as uint32)


@dataclass
class Config:
    """The run's settings; the defaults are `python -m syncer`'s (its flags take them
    from here)."""

    quorum: int = 1
    rounds: int = 0
    # the outer rule: auto = nesterov-warmup 0.4/0.9 for SFT (plain averaging to Nesterov
    # 0.4/0.9 over the first 20 rounds), plain averaging once an RL island joins
    # (syncer.strategy.RegimeNesterov; BENCHMARKS.md, "One outer rule for every regime")
    outer: str = "auto"
    outer_lr: float = 0.4
    outer_momentum: float = 0.9
    merge: str = "mean"         # the merge rule (syncer.strategy.RULES)
    grace_ms: int = 500
    grace: str = "auto"         # auto: syncer.grace (grace_ms until measured); fixed
    round_timeout_s: float = 600.0
    max_staleness: int = 1
    clip_factor: float = 0.0
    downlink: str = "f32"
    fragments: int = 1
    shard: Shard = field(default_factory=Shard)  # which fragments this syncer owns
    state_dir: Path | None = None
    resume: bool = False
    trust_unkeyed_state: bool = False  # resume an unkeyed state under the run's secret
    expect_islands: tuple[str, ...] = ()  # reserved slots, listed as "reserved" until joined
    seed_from: str = ""  # the island whose initial weights seed Θ ("": the first to join)
    bounds: Bounds = field(default_factory=Bounds)  # what one island can do (syncer.bounds)
    # a commit whose state cannot be saved is retried this long; then the syncer stops
    save_timeout_s: float = 120.0
    # the run's secret (--token / $YETO_TOKEN): keys the state's digest (syncer.persist)
    token: str | None = field(default=None, repr=False)
    # how it dials the other syncer of a primary-standby pair (syncer.standby.peer_tls;
    # None: plaintext)
    peer_tls: TLSConfig | None = field(default=None, repr=False)

    def public(self) -> dict[str, Any]:
        """The settings as plain data, without its secrets (the fields kept out of its
        repr: the run's token, the TLS key): what the dashboard and provenance.json show."""
        shown = {f.name for f in dataclasses.fields(self) if f.repr}
        return {k: v for k, v in dataclasses.asdict(self).items() if k in shown}

    def check(self) -> None:
        """Refuse settings that would make the outer step non-finite or meaningless."""
        if not 1 <= self.quorum <= MAX_QUORUM:
            raise ValueError(f"--quorum must be 1 to {MAX_QUORUM}, got {self.quorum}")
        if not (np.isfinite(self.outer_lr) and self.outer_lr > 0):
            raise ValueError(f"--outer-lr must be a positive number, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")
        if self.shard.count > max(1, self.fragments):
            raise ValueError(f"--shard {self.shard.index}/{self.shard.count}: {self.shard.count} "
                             f"shards need --fragments {self.shard.count} or more (each shard "
                             "owns whole fragments)")
        strategy.merge_rule(self.merge)
        strategy.outer_optimizer(self.outer, self.outer_lr, self.outer_momentum)
        self.bounds.check()
