"""The run on disk: what `syncer.state` saves after every commit and `--resume` loads,
and the final folder. The file formats live in `syncer.state`; this module maps a
`Run` to them and back (callers hold the run's lock)."""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

import numpy as np

from syncer import state
from yeto import frozen
from yeto.interop.adapters import run_adapter_tensors
from yeto.layout import Layout, TensorSpec

log = logging.getLogger("syncer")


def flags(cfg) -> dict:
    """The settings a resumed run must share (`state.MATH_FLAGS`)."""
    return {k: getattr(cfg, k) for k in state.MATH_FLAGS}


def state_key(cfg) -> state.StateKey:
    """What the run's state is signed with: its secret (`cfg.token`, set by `python -m
    syncer` from --token / $YETO_TOKEN; a Config without one has no secret)."""
    return state.StateKey(cfg.token)


def save(run, version: int, fragment: int) -> None:
    """The state as of `version`, committed by `fragment`'s round (raises OSError)."""
    if run.cfg.state_dir is None:
        return
    versions = [version if f == fragment else run.fragment_version(f)
                for f in range(run.cfg.fragments)]
    state.save(run.cfg.state_dir, run.theta, run.m, run.downlink.island_theta, dict(
        run_id=run.run_id, version=version, round=version, fragment_versions=versions,
        outer_steps={str(f): t for f, t in run.outer_steps.items()},
        norm_history=run.norms.saved(),
        fingerprint=run.layout.fingerprint,
        layout=[[s.name, list(s.shape), s.dtype] for s in run.layout.specs],
        flags=flags(run.cfg), weights_file=run.weights_file, export_files=run.export_files,
        bytes_in=run.bytes_in, bytes_out=run.bytes_out, islands=run.members.ledger()),
        key=state_key(run.cfg))


def restore_or_refuse(run, state_dir: Path, resume: bool) -> None:
    if (state_dir / state.STATE_FILE).exists() and not resume:
        raise state.StateError(
            f"{state_dir} already holds a run's state; continue it with --resume, or "
            "choose a new --state-dir (it is never overwritten silently)")
    if resume:
        restore(run, state_dir)


def restore(run, state_dir: Path) -> None:
    theta, momentum, island_theta, meta = state.load(state_dir, state_key(run.cfg))
    state.check_flags(meta, flags(run.cfg))
    specs = [TensorSpec(n, tuple(shape), dt) for n, shape, dt in meta["layout"]]
    run.layout = Layout(specs, run.cfg.fragments)
    if run.layout.fingerprint != meta["fingerprint"] or run.layout.numel != theta.size:
        raise state.StateError(f"{state_dir}: layout and weights disagree (corrupt state)")
    run.run_id, run.version = meta["run_id"], meta["version"]
    run.theta = theta
    if run.outer.keeps_momentum:
        run.m = momentum if momentum is not None else np.zeros_like(theta)
    run.downlink.island_theta = island_theta if run.cfg.downlink != "f32" else None
    run.commits = {f: [v] for f, v in enumerate(meta["fragment_versions"])}
    run.outer_steps = {int(f): t for f, t in meta.get("outer_steps", {}).items()}
    run.weights_file, run.export_files = meta["weights_file"], meta["export_files"]
    run.bytes_in, run.bytes_out = meta["bytes_in"], meta["bytes_out"]
    run.norms.restore(meta.get("norm_history", {}))
    if not run.norms.has_ceiling():  # a state saved before the bound had one
        run.norms.seed(theta, [run.span(f) for f in range(run.cfg.fragments)])
    run.members.restore(meta["islands"])
    log.info("resumed run %s at version %d (%d islands in the ledger)", run.run_id,
             run.version, len(run.members.rows))
    run.tape.write(dict(event="resumed", version=run.version, time=time.time()))


def write_final(run) -> None:
    """`state-dir/final/`: the final weights in the islands' file name, with frozen
    LoRA A rebuilt (it never travelled), their export files and provenance.json."""
    tensors = run_adapter_tensors(run.layout.unflatten(run.theta), run.export_files)
    files = dict(run.export_files)
    files.pop(frozen.EXPORT_FILE, None)  # A is rebuilt above: the seed file stays out
    record = state.final_provenance(run.cfg, run_record(run))
    state.write_final(run.cfg.state_dir / state.FINAL_DIR, run.weights_file, tensors,
                      run.version, files, record)


def run_record(run) -> dict:
    """What the final weights are: for provenance.json."""
    return dict(run_id=run.run_id, version=run.version, weights_file=run.weights_file,
                theta_sha256=state.digest(run.theta), fingerprint=run.layout.fingerprint,
                parameters=int(run.layout.numel), islands=run.members.ledger())


def digest(run) -> str:
    """SHA-256 over everything a rejected message must leave untouched."""
    h = hashlib.sha256(f"{run.version}|{run.started}|{run.finished}".encode())
    for a in (run.theta, run.m):
        h.update(b"-" if a is None else memoryview(a).cast("B"))
    for f, rnd in sorted(run.open.items()):
        summed = rnd.acc.summed()
        h.update(b"-" if summed is None else memoryview(summed).cast("B"))
        h.update(repr((f, len(rnd.responders), rnd.acc.total_weight,
                       rnd.acc.count)).encode())
    h.update(repr(run.members.digest_parts()).encode())
    return h.hexdigest()
