"""The run on disk: the state `syncer.state` saves after every commit and `--resume`
loads, and the final folder. The file formats live in `syncer.state`; `Store` owns the
state dir and what signs it, and moves records in and out (callers hold the run's lock).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from syncer import state
from syncer.config import Config
from syncer.model import Restored
from yeto import frozen
from yeto.frozen import run_adapter_tensors
from yeto.layout import Layout, TensorSpec

log = logging.getLogger("syncer")


@dataclass
class Saved:
    """A run as `--resume` reads it back."""

    model: Restored
    island_theta: np.ndarray | None
    meta: dict[str, Any]

    @property
    def fragment_versions(self) -> list[int]:
        return list(self.meta["fragment_versions"])


class Store:
    """The run's state dir: `state-dir/state.safetensors` and `state-dir/final/`."""

    def __init__(self, cfg: Config):
        if cfg.state_dir is None:
            raise ValueError("a Store needs a state dir")
        self.cfg = cfg
        self.dir: Path = cfg.state_dir
        self.key = state.StateKey(cfg.token)  # the run's secret signs its state

    def flags(self) -> dict[str, Any]:
        """The settings a resumed run must share (`state.MATH_FLAGS`)."""
        return {k: getattr(self.cfg, k) for k in state.MATH_FLAGS}

    def refuse_existing(self) -> None:
        """A new run never overwrites a saved one silently."""
        if (self.dir / state.STATE_FILE).exists():
            raise state.StateError(
                f"{self.dir} already holds a run's state; continue it with --resume, or "
                "choose a new --state-dir (it is never overwritten silently)")

    def save(self, theta: np.ndarray, momentum: np.ndarray | None,
             island_theta: np.ndarray | None, meta: dict[str, Any]) -> None:
        """The state as `meta` describes it (raises OSError: the caller retries)."""
        state.save(self.dir, theta, momentum, island_theta, dict(meta, flags=self.flags()),
                   key=self.key)

    def load(self) -> Saved:
        """The saved run, checked: the key, the flags, the layout against the weights."""
        theta, momentum, island_theta, meta = state.load(
            self.dir, self.key, trust_unkeyed=self.cfg.trust_unkeyed_state)
        state.check_flags(meta, self.flags())
        shard = self.cfg.shard
        if meta.get("shard", [0, 1]) != [shard.index, shard.count]:
            saved = meta.get("shard", [0, 1])
            raise state.StateError(f"{self.dir} holds shard {saved[0]}/{saved[1]} of its run; "
                                   f"this syncer is --shard {shard.index}/{shard.count}")
        specs = [TensorSpec(n, tuple(shape), dt) for n, shape, dt in meta["layout"]]
        layout = Layout(specs, self.cfg.fragments)
        if layout.fingerprint != meta["fingerprint"] or layout.numel != theta.size:
            raise state.StateError(f"{self.dir}: layout and weights disagree (corrupt state)")
        model = Restored(layout, theta, momentum,
                         {int(f): t for f, t in meta.get("outer_steps", {}).items()},
                         meta["weights_file"], meta["export_files"])
        return Saved(model, island_theta if self.cfg.downlink != "f32" else None, meta)

    def write_final(self, layout: Layout, theta: np.ndarray, weights_file: str,
                    export_files: dict[str, str], version: int, record: dict[str, Any]) -> None:
        """`state-dir/final/`: the final weights in the islands' file name, with frozen
        LoRA A rebuilt (it never travelled), their export files and provenance.json
        (`record`: what the run says of itself)."""
        tensors = run_adapter_tensors(layout.unflatten(theta), export_files)
        files = dict(export_files)
        files.pop(frozen.EXPORT_FILE, None)  # A is rebuilt above: the seed file stays out
        state.write_final(self.dir / state.FINAL_DIR, weights_file, tensors, version, files,
                          state.final_provenance(self.cfg, record))
