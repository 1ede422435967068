"""`yeto launch`: real syncer and island processes; Ctrl-C stops with outputs saved.

The islands are the ordinary island programs (`python -m yeto.learner`): the launcher
passes a Ctrl-C on to them as SIGINT, and each one finishes its step, pushes, receives
the final weights and saves, by its own signal handling.

Here: the checks through in-process servers, training or the sim (the others:
tests/unit/test_launch.py, tests/e2e/test_launch.py)."""


import sys

from helpers.launch import external_run

from yeto.cli.local_run import LaunchConfig, LocalRun


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


def test_join_commands_carry_everything_but_the_secret(tmp_path):
    from yeto.cli.join import shell_lines

    ca = tmp_path / "ca.pem"
    ca.write_text("cert")
    run = external_run(tmp_path, token="s3cret-token-value", tls_cert=ca,
                        tls_key=tmp_path / "key")
    lines = run.reserve_external()
    text = "\n".join(lines)
    assert "s3cret-token-value" not in text and run.token_file is None
    assert (run.out / "join.txt").read_text() == text
    blocks = text.split("\n\n")
    first, second = (shell_lines(b.splitlines()) for b in blocks[:2])
    assert first[0] == ("printf 'YETO_TOKEN: ' >&2; read -rs YETO_TOKEN; export YETO_TOKEN; "
                        "echo >&2")
    assert first[1:] == ['pip install "yeto[torch]"', (
        "python -m yeto.learner --syncer 198.51.100.7:29400 --learner-id island-1 "
        "--learner-index 1 --num-learners 3 --model hub/model --data hub/data "
        f"--tls-ca {ca} --output island-1 --max-steps 7")]
    assert '#   pip install "yeto[mlx]"' in blocks[0]  # the MLX alternative of an "any" slot
    assert second[1] == 'pip install "yeto[mlx]"'
    assert second[2].startswith("python -m yeto.mlx.learner --syncer 198.51.100.7:29400 "
                                "--learner-id island-2 --learner-index 2 --num-learners 3")
    assert second[2].endswith("--mlx-flag")
    # the local island shares the data with the slots and trusts the same certificate
    cmd = run.island_command(0, "torch", tmp_path / "i0")
    flags = dict(zip(cmd[3:], cmd[4:]))
    assert flags["--num-learners"] == "3" and flags["--tls-ca"] == str(ca)
    assert [(i.id, i.state) for i in run.external()] == [
        ("island-1", "waiting (external)"), ("island-2", "waiting (external)")]
