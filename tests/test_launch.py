"""`yeto launch`: real syncer and island processes; Ctrl-C stops with outputs saved.

The islands are the ordinary island programs (`python -m yeto.learner`): the launcher
passes a Ctrl-C on to them as SIGINT, and each one finishes its step, pushes, receives
the final weights and saves, by its own signal handling."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from syncer.tape import read_tape
from yeto.cli import launch
from yeto.cli.launch import Display, IslandProc, LaunchConfig, LocalRun, render_table

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--seq-len", "64", "--batch-size", "4", "--lora-r", "4", "--eval-blocks", "8",
         "--inner-lr", "3e-3"]


def _launch_cmd(out, model, train, held_out, *extra):
    return [sys.executable, "-m", "yeto", "launch", "--model", str(model), "--data", str(train),
            "--eval-data", str(held_out), "--out", str(out), "--display", "plain", *SMALL, *extra]


def test_ctrl_c_stops_everything_with_outputs_saved(tmp_path, tiny_llama, tiny_task):
    train, held_out = tiny_task
    out = tmp_path / "run"
    proc = subprocess.Popen(_launch_cmd(out, tiny_llama, train, held_out, "--max-steps", "5000",
                                        "--sync-every", "2"),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        t0 = time.monotonic()
        for line in proc.stdout:  # wait until training is under way: a merged round
            lines.append(line)
            if line.startswith("round   1:"):
                break
            assert time.monotonic() - t0 < 240, "".join(lines)
        proc.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends
        rest, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    stdout = "".join(lines) + rest
    assert proc.returncode == 130, stdout
    assert "SIGINT: stopping the islands" in stdout
    assert f"outputs in {out}" in stdout and "stopped early by a signal" in stdout
    # the run finished cleanly: the syncer wrote final/, every island saved an adapter
    # bit-identical to it, and summary.json is there
    final = load_file(out / "adapter" / "adapter_model.safetensors")
    for island in ("island-0", "island-1"):
        mine = load_file(out / "islands" / island / "adapter" / "adapter_model.safetensors")
        assert mine.keys() == final.keys()
        assert all(np.array_equal(mine[k], final[k]) for k in final), island
        s = json.loads((out / "islands" / island / "summary.json").read_text())
        assert s["final"] is True and 2 <= s["step"] < 5000
        # the island program itself took the signal and stopped cleanly (no wrapper)
        assert "SIGINT: stopping after this step" in \
            (out / "islands" / island / "log.txt").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] >= 1 and set(summary["islands"]) == {"island-0", "island-1"}
    assert all(v["final"] for v in summary["islands"].values())
    merges = [r for r in read_tape(out / "syncer" / "tape.jsonl") if r["event"] == "merge"]
    assert len(merges) == summary["rounds"]
    # the display: a status table with both islands, and the syncer's dashboard URL
    assert "island-0  torch" in stdout and "island-1  torch" in stdout
    assert "dashboard http://127.0.0.1:" in stdout
    # a second launch into the same folder refuses to overwrite it
    again = subprocess.run(_launch_cmd(out, tiny_llama, train, held_out, "--max-steps", "3"),
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "--overwrite" in again.stderr


def test_a_failing_island_stops_the_run_with_its_log(tmp_path, tiny_llama, tiny_task):
    train, held_out = tiny_task
    out = tmp_path / "bad"
    r = subprocess.run(_launch_cmd(out, tiny_llama, train, held_out, "--islands", "torch",
                                   "--max-steps", "3", "--no-such-flag", "1", "--no-dashboard"),
                       cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "island-0 exited with code 2" in r.stdout
    assert "unrecognized arguments: --no-such-flag" in r.stdout  # the island's log tail


@pytest.mark.parametrize("argv, words", [
    (["--islands", "torch,cuda", "--model", "m", "--data", "d"], "use a comma list of torch"),
    (["--islands", "torch"], "--model and --data are required"),
    (["--model", "m", "--data", "d", "--learner-id", "x"], "the launcher sets these"),
    (["--model", "m", "--data", "d", "--report-to", "wandb"], "wandb: unknown"),
])
def test_launch_refuses_bad_flags(capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        launch.main(argv)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_tensorboard_flag_without_the_package_says_how_to_install(capsys, monkeypatch):
    import yeto.metrics as metrics

    def missing():
        raise metrics.MetricsError("--report-to tensorboard needs the tensorboard package, "
                                   "which is not installed: pip install tensorboard")

    monkeypatch.setattr(metrics, "tensorboard_writer_class", missing)
    with pytest.raises(SystemExit):
        launch.main(["--model", "m", "--data", "d", "--report-to", "tensorboard"])
    assert "pip install tensorboard" in capsys.readouterr().err


def test_display_reads_metrics_and_tape(tmp_path):
    """The live table: step, losses, tokens/s, round and state from the islands'
    metrics.jsonl and the tape, without any process."""
    out = tmp_path / "run"
    cfg = LaunchConfig(out=out, backends=["torch", "mlx"], model="m", data="d", max_steps=40)
    run = LocalRun(cfg)
    (out / "syncer").mkdir(parents=True)
    now = time.time()
    for i, backend in enumerate(cfg.backends):
        d = out / "islands" / f"island-{i}"
        d.mkdir(parents=True)
        recs = [dict(step=0, eval_loss=2.5, version=0, time=now - 10),
                dict(step=20, train_loss=1.9 + i, eval_loss=2.1, version=1)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs)
                                         + '{"step": 40, "trai')  # a line being written
        isl = IslandProc(f"island-{i}", backend, d, [], metrics=launch.JsonlFollower(
            d / "metrics.jsonl"))
        isl.proc = _Done()
        run.islands.append(isl)
    (out / "syncer" / "tape.jsonl").write_text(json.dumps(dict(
        event="merge", round=1, version=1, bytes_in=1000, bytes_out=4000, time=now,
        responders=[dict(learner="island-0", tokens=500), dict(learner="island-1",
                                                               tokens=300)])) + "\n")
    new, exited = run.poll(with_status=False)
    assert len(new) == 1 and [i.id for i in exited] == ["island-0", "island-1"]
    a, b = run.islands
    assert (a.step, a.train_loss, a.eval_loss, a.version, a.pushes) == (20, 1.9, 2.1, 1, 1)
    assert b.train_loss == 2.9 and b.state == "done"
    assert 45 < run.rate(a) < 55  # 500 tokens over the 10 s since its step 0
    text = render_table(run)
    assert "island-0  torch    20/40" in text and "island-1  mlx" in text
    assert "round 1" in text and "1.0 kB" in text
    lines = []

    class Stream:
        def write(self, s):
            lines.append(s)

        def flush(self):
            pass

        def isatty(self):
            return False

    d = Display("auto", stream=Stream(), status_every_s=1e9)
    d.update(run, new, exited)
    text = "".join(lines)
    assert d.mode == "plain" and "round   1: island-0 500 tok, island-1 300 tok" in text
    assert "island-0 done at step 20" in text


class _Done:
    returncode = 0

    def poll(self):
        return 0


@pytest.mark.slow
@pytest.mark.mlx
def test_launch_torch_and_mlx_islands(tmp_path, tiny_llama, tiny_task):
    pytest.importorskip("mlx_lm")
    train, held_out = tiny_task
    out = tmp_path / "mixed"
    r = subprocess.run(_launch_cmd(out, tiny_llama, train, held_out, "--islands", "torch,mlx",
                                   "--max-steps", "12", "--sync-every", "4"),
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "island-1  mlx" in r.stdout and "held-out loss:" in r.stdout
    final = load_file(out / "adapter" / "adapter_model.safetensors")
    for island in ("island-0", "island-1"):
        mine = load_file(out / "islands" / island / "adapter" / "adapter_model.safetensors")
        assert all(np.array_equal(mine[k], final[k]) for k in final), island
    merges = [r for r in read_tape(out / "syncer" / "tape.jsonl") if r["event"] == "merge"]
    assert len(merges) == 3


def test_islands_are_the_island_programs_themselves(tmp_path):
    """No wrapper: each island is `python -m yeto.learner` / `python -m yeto.mlx.learner`
    with the run's flags, so its own signal handling stops it cleanly."""
    cfg = LaunchConfig(out=tmp_path, backends=["torch", "mlx"], model="m", data="d",
                       eval_data="e", island_args=["--max-steps", "7"])
    run = LocalRun(cfg)
    run.address = "127.0.0.1:1234"
    torch_cmd = run.island_command(0, "torch", tmp_path / "i0")
    mlx_cmd = run.island_command(1, "mlx", tmp_path / "i1")
    assert torch_cmd[:3] == [sys.executable, "-m", "yeto.learner"]
    assert mlx_cmd[:3] == [sys.executable, "-m", "yeto.mlx.learner"]
    for i, cmd in enumerate((torch_cmd, mlx_cmd)):
        flags = dict(zip(cmd[3::1], cmd[4::1]))
        assert flags["--syncer"] == "127.0.0.1:1234" and flags["--learner-id"] == f"island-{i}"
        assert flags["--num-learners"] == "2" and flags["--max-steps"] == "7"
        assert flags["--eval-data"] == "e" and flags["--output"] == str(tmp_path / f"i{i}")


def test_a_syncer_that_cannot_start_is_reported_with_its_output(tmp_path, capsys):
    """syncer.spawn: a syncer that exits before it listens fails at once with the end of
    its output (no waiting out a timeout); the launcher says so and exits 2."""
    from syncer.spawn import SyncerStartError, start_syncer

    t0 = time.monotonic()
    with pytest.raises(SyncerStartError, match="unrecognized arguments: --bogus"):
        start_syncer(["--bogus"], timeout_s=120)
    assert time.monotonic() - t0 < 60
    code = launch.main(["--model", "m", "--data", "d", "--out", str(tmp_path / "run"),
                        "--syncer-args=--bogus", "--display", "none"])
    err = capsys.readouterr().err
    assert code == 2 and "exited with code 2 before it listened" in err and "--bogus" in err


def test_plain_tables_are_parseable_and_never_wrapped():
    """yeto.cli.display off a terminal: columns two spaces apart, a rule under the
    header, cells taken literally (no rich markup), wide tables on one line each."""
    from yeto.cli.display import table_text

    headers = [f"column {i}" for i in range(30)]
    text = table_text(headers, [["[bold]x[/bold]", *range(29)], ["[::1]:29400", *range(29)]],
                      right=range(1, 30))
    lines = text.splitlines()
    assert len(lines) == 4 and set(lines[1]) == {"-"}
    assert re.split(r"\s{2,}", lines[0]) == headers
    assert lines[2].startswith("[bold]x[/bold]") and lines[3].startswith("[::1]:29400")
    assert "\x1b" not in text and all(line == line.rstrip() for line in lines)
