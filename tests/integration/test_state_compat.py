"""A state saved by an earlier release resumes: tests/data/state-ea63bc5/ was written by
the syncer at commit ea63bc5 (one island, a LoRA layout of 32 values, 2 committed
rounds, no secret; `theta.npy` is its Θ as that syncer held it)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from syncer.run import Config, PushHeader, Run
from syncer.staging import WholePush
from yeto import codec
from yeto.layout import Layout

SAVED = Path(__file__).resolve().parents[1] / "data" / "state-ea63bc5"
OUTER = "nesterov-warmup"  # that syncer's default outer rule (a resume passes the run's)
LAYOUT = Layout.from_shapes({"m.q_proj.lora_A.weight": (2, 8), "m.q_proj.lora_B.weight": (8, 2)})


def test_a_state_saved_by_ea63bc5_resumes_and_goes_on(tmp_path):
    state_dir = tmp_path / "s"
    state_dir.mkdir()
    shutil.copy(SAVED / "state.safetensors", state_dir)
    run = Run(Config(quorum=1, outer=OUTER, state_dir=state_dir, resume=True))
    try:
        assert run.version == 2 and run.layout.fingerprint == LAYOUT.fingerprint
        assert run.theta.tobytes() == np.load(SAVED / "theta.npy").tobytes()
        assert run.members.ledger()["old-island"]["pushes"] == 2
        joined = run.join("old-island", LAYOUT.specs, LAYOUT.fingerprint, "numpy",
                          "adapter_model.safetensors", {"adapter_config.json": "{}"},
                          tokens_per_step=64)
        assert not joined["send_seed"] and joined["last_seq"] == 2
        delta = np.full(LAYOUT.numel, 0.01, np.float32)
        reply = run.push(PushHeader("old-island", joined["generation"], 3, 0, 2, 10, 1, "f32",
                                    LAYOUT.numel, 4 * LAYOUT.numel, False, 3),
                         WholePush(codec.encode(delta, "f32")))
        assert reply["accepted"] and run.version == 3
    finally:
        run.tape.close()
    again = Run(Config(quorum=1, outer=OUTER, state_dir=state_dir, resume=True))  # ours
    assert again.version == 3 and again.theta.tobytes() == run.theta.tobytes()
    again.tape.close()


def test_a_keyed_run_resumes_an_unkeyed_state_only_when_the_operator_vouches(tmp_path):
    """A run with a secret refuses a state saved without one (anyone who could write its
    folder could have made it) and names the flag; with --trust-unkeyed-state it
    resumes, and its next save is keyed."""
    import pytest

    from syncer import state

    state_dir = tmp_path / "s"
    state_dir.mkdir()
    shutil.copy(SAVED / "state.safetensors", state_dir)
    with pytest.raises(state.StateError, match="--trust-unkeyed-state"):
        Run(Config(quorum=1, outer=OUTER, state_dir=state_dir, resume=True, token="s3"))
    run = Run(Config(quorum=1, outer=OUTER, state_dir=state_dir, resume=True, token="s3",
                     trust_unkeyed_state=True))
    gen = run.join("old-island", LAYOUT.specs, LAYOUT.fingerprint, "numpy",
                   "adapter_model.safetensors", {"adapter_config.json": "{}"},
                   tokens_per_step=64)["generation"]
    run.push(PushHeader("old-island", gen, 3, 0, 2, 10, 1, "f32", LAYOUT.numel,
                        4 * LAYOUT.numel, False, 3),
             WholePush(codec.encode(np.full(LAYOUT.numel, 0.01, np.float32), "f32")))
    run.tape.close()
    assert run.version == 3
    back = Run(Config(quorum=1, outer=OUTER, state_dir=state_dir, resume=True, token="s3"))
    assert back.version == 3  # keyed now: no flag needed
    back.tape.close()
