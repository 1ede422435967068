"""`yeto status` and the syncer's dashboard, against real syncers and islands.

Here: the checks that need no process, server or training (the others:
tests/integration/test_status_dashboard.py, tests/e2e/test_status_dashboard.py)."""


from yeto.cli import status as status_cli


def test_status_of_a_syncer_that_is_not_there(capsys):
    assert status_cli.main(["127.0.0.1:1", "--timeout", "2"]) == 1
    assert "is the syncer running?" in capsys.readouterr().err
