"""The Python API: the examples (a torch loop, a HF Trainer, mlx-lm's trainer) run
against a real in-process syncer on the tiny model, and end bit-identical to it.

Here: the checks that need no process, server or training (the others:
tests/integration/test_integrations.py)."""


import numpy as np
import pytest

from yeto import metrics
from yeto.interop.integrations import count_loss_tokens
from yeto.io import JsonlFollower


# ---- helpers --------------------------------------------------------------------------
def test_count_loss_tokens():
    labels = np.array([[-100, -100, 5, 6, -100], [3, 7, 8, 9, 10]])
    assert count_loss_tokens(labels) == 2 + 4  # the first position never has a loss
    assert count_loss_tokens(labels, shifted=True) == 7
    import torch

    assert count_loss_tokens(torch.from_numpy(labels)) == 6


def test_metrics_jsonl_follower_and_tensorboard_writer(tmp_path, monkeypatch):
    w = metrics.MetricsWriter(tmp_path)
    w.write(dict(step=1, train_loss=2.5, eval_loss=float("nan")))
    f = JsonlFollower(tmp_path / "metrics.jsonl")
    assert [r["train_loss"] for r in f.read_new()] == [2.5]
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 2, "train_lo')  # a line still being written
    assert f.read_new() == []
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('ss": 2.0}\n')
    assert [r["step"] for r in f.read_new()] == [2]
    # tensorboard: numeric fields become scalars (a stand-in SummaryWriter records them)
    calls = []

    class FakeWriter:
        def __init__(self, log_dir):
            calls.append(("dir", log_dir))

        def add_scalar(self, tag, value, global_step=None, walltime=None):
            calls.append((tag, value, global_step))

        def flush(self):
            pass

        def close(self):
            calls.append("closed")

    monkeypatch.setattr(metrics, "tensorboard_writer_class", lambda: FakeWriter)
    w = metrics.MetricsWriter(tmp_path / "tb", "tensorboard", prefix="island-0")
    w.write(dict(step=3, train_loss=1.5, eval_loss=None, version=2, note="x"))
    w.close()
    assert calls[0] == ("dir", str(tmp_path / "tb" / "tensorboard"))
    assert ("island-0/train_loss", 1.5, 3) in calls and ("island-0/version", 2.0, 3) in calls
    assert not any(c[0].endswith(("eval_loss", "note")) for c in calls if isinstance(c, tuple))
    assert (tmp_path / "tb" / "metrics.jsonl").exists()  # the JSONL is written either way


def test_tensorboard_missing_is_a_clear_error():
    try:
        metrics.tensorboard_writer_class()
    except metrics.MetricsError as e:
        assert "pip install tensorboard" in str(e)
    else:
        pytest.skip("tensorboard is installed here")
    with pytest.raises(metrics.MetricsError, match="pip install tensorboard"):
        metrics.check_report_to("tensorboard")
    assert metrics.check_report_to("jsonl") == ("jsonl",)


def test_diloco_given_the_optimizer_stages_its_pushes_behind_a_step_pre_hook():
    """`DiLoCo(..., optimizer=opt)`: the island's guard is a pre-hook of the optimizer's
    step (pushes may then be staged in the background); without it, none."""
    import torch

    from yeto.interop.integrations import DiLoCo

    for given in (True, False):
        model = torch.nn.Linear(8, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        diloco = DiLoCo(model, syncer=None, optimizer=opt if given else None)
        assert diloco.island.stager.guarded is given
        assert len(opt._optimizer_step_pre_hooks) == int(given)
        model(torch.ones(2, 8)).sum().backward()
        opt.step()  # the guard runs first: nothing pending, it returns at once
        assert diloco.step(2) is False


def test_trainer_callback_guards_the_optimizer_accelerate_wraps():
    """The Trainer hands callbacks accelerate's AcceleratedOptimizer; the guard goes on
    the optimizer it steps, so a push is staged while the next step's passes run."""
    import types

    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from yeto.interop.integrations import DiLoCoCallback

    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        wrapped = Accelerator(cpu=True).prepare(opt)
        assert wrapped is not opt and wrapped.optimizer is opt
        callback = DiLoCoCallback(syncer=None)
        callback.on_train_begin(types.SimpleNamespace(output_dir=None), None, None,
                                model=model, optimizer=wrapped)
    finally:
        AcceleratorState._reset_state(True)  # the Trainer tests make their own
    assert callback.diloco.island.stager.guarded
    assert len(opt._optimizer_step_pre_hooks) == 1
