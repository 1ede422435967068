"""`yeto launch`: real syncer and island processes; Ctrl-C stops with outputs saved.

The islands are the ordinary island programs (`python -m yeto.learner`): the launcher
passes a Ctrl-C on to them as SIGINT, and each one finishes its step, pushes, receives
the final weights and saves, by its own signal handling.

Here: the checks that need no process, server or training (the others:
tests/integration/test_launch.py, tests/e2e/test_launch.py)."""


import json
import re
import time

import pytest
from helpers.launch import external_run

from yeto.cli import launch, local_run
from yeto.cli.launch_view import Display, render_table
from yeto.cli.local_run import LaunchConfig, LocalRun
from yeto.cli.progress import IslandProc
from yeto.io import JsonlFollower


@pytest.mark.parametrize("argv, words", [
    (["--islands", "torch,cuda", "--model", "m", "--data", "d"], "use a comma list of torch"),
    (["--islands", "torch"], "--model and --data are required"),
    (["--model", "m", "--data", "d", "--learner-id", "x"], "the launcher sets these"),
    (["--model", "m", "--data", "d", "--report-to", "wandb"], "wandb: unknown"),
    (["--model", "m", "--data", "d", "--shards", "0"], "--shards 0: give at least 1"),
    (["--model", "m", "--data", "d", "--shards", "3", "--fragments", "2"],
     "needs --fragments >= 3"),
    (["--model", "m", "--data", "d", "--shards", "2", "--external-islands", "1"],
     "--shards with --external-islands or --tls-cert: not yet"),
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
        isl = IslandProc(f"island-{i}", backend, d, [], metrics=JsonlFollower(
            d / "metrics.jsonl"))
        isl.proc = _Done()
        run.islands.append(isl)
    (out / "syncer" / "tape.jsonl").write_text(json.dumps(dict(
        event="merge", round=1, version=1, bytes_in=1000, bytes_out=4000, time=now,
        responders=[dict(learner="island-0", tokens=500), dict(learner="island-1",
                                                               tokens=300)])) + "\n")
    # between pushes an island rewrites progress.json: the view follows its step
    (out / "islands" / "island-1" / "progress.json").write_text('{"step": 27, "train_loss": 2.5}')
    new, exited = run.poll(with_status=False)
    assert len(new) == 1 and [i.id for i in exited] == ["island-0", "island-1"]
    a, b = run.islands
    assert (a.step, a.train_loss, a.eval_loss, a.version, a.pushes) == (20, 1.9, 2.1, 1, 1)
    assert (b.step, b.train_loss) == (27, 2.5) and b.state == "done"
    assert 45 < run.progress.rate(a) < 55  # 500 tokens over the 10 s since its step 0
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
    # the periodic status off a terminal: a line per island, each value named, no
    # table header repeated into the log
    lines.clear()
    d.status_every_s = 0.0
    d.update(run, [], [])
    status = "".join(lines).splitlines()
    assert len(status) == 3 and status[0].startswith("syncer ")
    assert "island island-0  backend torch  step 20/40" in status[1]
    assert not any(line.startswith("island  ") or set(line) == {"-"} for line in status)


class _Done:
    returncode = 0

    def poll(self):
        return 0


def test_plain_tables_are_parseable_and_never_wrapped():
    """yeto.display off a terminal: columns two spaces apart, a rule under the
    header, cells taken literally (no rich markup), wide tables on one line each."""
    from yeto.display import table_text

    headers = [f"column {i}" for i in range(30)]
    text = table_text(headers, [["[bold]x[/bold]", *range(29)], ["[::1]:29400", *range(29)]],
                      right=range(1, 30))
    lines = text.splitlines()
    assert len(lines) == 4 and set(lines[1]) == {"-"}
    assert re.split(r"\s{2,}", lines[0]) == headers
    assert lines[2].startswith("[bold]x[/bold]") and lines[3].startswith("[::1]:29400")
    assert "\x1b" not in text and all(line == line.rstrip() for line in lines)


# ---- external island slots ---------------------------------------------------------------
def test_external_slot_specs():
    from yeto.cli.join import JoinError, parse_slots

    assert parse_slots("2") == ["any", "any"]
    assert parse_slots("mlx:1, torch:2") == ["mlx", "torch", "torch"]
    assert parse_slots("") == []
    for bad in ("cuda:1", "mlx:x", "one"):
        with pytest.raises(JoinError, match="torch:N, mlx:N"):
            parse_slots(bad)


def test_the_address_other_machines_dial(monkeypatch):
    """--advertise-host wins; a specific --host is itself; a wildcard asks the default
    route, then the interfaces; loopback is refused (with the fix in the message)."""
    from yeto.cli import join

    assert join.advertise_host("0.0.0.0", "syncer.example.org") == "syncer.example.org"
    assert join.advertise_host("198.51.100.7") == "198.51.100.7"
    with pytest.raises(join.JoinError, match="--host 0.0.0.0"):
        join.advertise_host("127.0.0.1")
    assert join.advertise_host("127.0.0.1", "198.51.100.9") == "198.51.100.9"  # a tunnel
    monkeypatch.setattr(join, "route_address", lambda: "198.51.100.20")
    assert join.advertise_host("0.0.0.0") == "198.51.100.20"
    monkeypatch.setattr(join, "route_address", lambda: None)
    monkeypatch.setattr(join, "interface_address", lambda: "198.51.100.21")
    assert join.advertise_host("::") == "198.51.100.21"
    monkeypatch.setattr(join, "interface_address", lambda: None)
    monkeypatch.setattr(join, "hostname_address", lambda: None)
    with pytest.raises(join.JoinError, match="--advertise-host"):
        join.advertise_host("0.0.0.0")


def test_without_a_token_launch_makes_one_only_the_user_can_read(tmp_path, monkeypatch):
    monkeypatch.delenv("YETO_TOKEN", raising=False)
    run = external_run(tmp_path)
    token = (run.out / "token").read_text().strip()
    assert len(token) == 32 and (run.out / "token").stat().st_mode & 0o777 == 0o600
    assert run.env["YETO_TOKEN"] == token
    text = "\n".join(run.reserve_external())
    assert token not in text and f"in {run.out / 'credentials'}/island-1 on this machine" in text
    # each slot holds its own credential (never the run's token), readable by the user only
    from yeto import net

    cred = run.out / "credentials" / "island-1"
    assert cred.read_text().strip() == net.island_credential(token, "island-1")
    assert cred.stat().st_mode & 0o777 == 0o600
    assert net.credential_valid(token, cred.read_text().strip()) == "island-1"


def test_external_slots_count_in_the_quorum_and_show_as_waiting(tmp_path, monkeypatch):
    """The syncer's quorum counts the slots; the display shows them waiting until the
    syncer's Status or the tape says they joined."""
    started = {}

    class Syncer:
        address, dashboard_url, port = "198.51.100.7:29400", None, 29400

        def poll(self):
            return None

    def fake_start(args, **kw):
        started.update(args=args, **kw)
        return Syncer()

    monkeypatch.setattr(local_run, "start_syncer", fake_start)
    cfg = launch.config_from_args(launch.build_parser(), *launch.build_parser().parse_known_args(
        ["--islands", "none", "--external-islands", "torch:2", "--model", "m", "--data", "d",
         "--host", "198.51.100.7", "--token", "t", "--out", str(tmp_path / "run")]))
    assert cfg.backends == [] and cfg.port == 29400 and cfg.num_islands == 2
    run = LocalRun(cfg)
    run.prepare()
    run.start_syncer()
    assert started["args"][:2] == ["--quorum", "2"] and started["host"] == "198.51.100.7"
    assert run.join_address == "198.51.100.7:29400"
    run.reserve_external()
    text = render_table(run)
    assert "waiting for 2 external islands" in text
    assert re.search(r"island-0\s+torch\s+-.*waiting \(external\)", text)
    (run.syncer_dir / "tape.jsonl").write_text(json.dumps(dict(
        event="merge", round=1, version=1, bytes_in=10, bytes_out=10, time=time.time(),
        responders=[dict(learner="island-0", tokens=50, steps=4, train_loss=2.5)])) + "\n")
    run.poll(with_status=False)
    assert run.progress.notes == ["island-0 joined from another machine (torch)"]
    text = render_table(run)
    assert "waiting for 1 external island " in text
    assert re.search(r"island-0\s+torch\s+4/200\s+2\.500.*training", text)
    assert re.search(r"island-1\s+torch\s+-.*waiting \(external\)", text)


def test_join_commands_carry_the_run_file(tmp_path):
    """`yeto launch --config run.toml --external-islands 1`: the slot's command reads the
    same run file, and the block says it must be at that path on the other machine."""
    from yeto.cli.join import JoinSpec, join_block, shell_lines

    config = tmp_path / "run.toml"
    config.write_text("[run]\nsync_every = 5\n")
    spec = JoinSpec(address="198.51.100.7:29400", model="hub/model", data="hub/data",
                    num_learners=2, island_args=["--config", str(config)])
    block = join_block(spec, "torch", "island-1", 1)
    assert shell_lines(block)[-1].endswith(f"--output island-1 --config {config}")
    assert any(line.startswith(f"  # {config}: paths on this machine") for line in block)


def test_torch_only_flags_reach_torch_islands_only(tmp_path):
    """`yeto launch --islands torch,mlx --threads 1` passed --threads to the MLX island,
    which refused it (and the launch ended in an unrelated traceback)."""
    from yeto.cli.local_run import LaunchConfig, LocalRun

    run = LocalRun(LaunchConfig(out=tmp_path, backends=["torch", "mlx"], model="m", data="d",
                                island_args=["--threads", "1", "--device=cpu", "--max-steps",
                                             "5"]))
    torch_cmd = run.island_command(0, "torch", tmp_path / "a")
    mlx_cmd = run.island_command(1, "mlx", tmp_path / "b")
    assert torch_cmd[torch_cmd.index("--threads") + 1] == "1" and "--device=cpu" in torch_cmd
    assert "--threads" not in mlx_cmd and not any(a.startswith("--device") for a in mlx_cmd)
    assert mlx_cmd[mlx_cmd.index("--max-steps") + 1] == "5"


def test_shards_give_each_syncer_its_shard_and_enough_fragments():
    p = launch.build_parser()
    args, rest = p.parse_known_args(["--model", "m", "--data", "d", "--shards", "2"])
    cfg = launch.config_from_args(p, args, rest)
    assert cfg.shards == 2 and cfg.syncer_args[-2:] == ["--fragments", "2"]
    args, rest = p.parse_known_args(["--model", "m", "--data", "d", "--shards", "2",
                                     "--fragments", "4"])
    assert launch.config_from_args(p, args, rest).syncer_args.count("--fragments") == 1
