"""What the launch tests in more than one tier share."""

from yeto.cli.local_run import LaunchConfig, LocalRun


def external_run(tmp_path, **kw) -> LocalRun:
    cfg = LaunchConfig(out=tmp_path / "run", backends=["torch"], model="hub/model",
                       data="hub/data", island_args=["--max-steps", "7"], host="0.0.0.0",
                       advertise_host="198.51.100.7", external=["any", "mlx"],
                       backend_args={"mlx": ["--mlx-flag"]}, **kw)
    run = LocalRun(cfg)
    run.prepare()
    run.join_address = "198.51.100.7:29400"
    return run
