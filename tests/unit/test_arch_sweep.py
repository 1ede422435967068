"""The architecture sweep's RESULT (yeto.testing.arch_sweep): counted over the
architectures both libraries implement; rows of a model type whose mlx-lm module is
another architecture are named and left out, and the count over every row is printed
beside it."""

from yeto.testing import arch_sweep as sweep


def _row(arch, status, stage="mlx-load", error="TypeError: missing argument"):
    row = {"arch": arch, "stage": stage, "error": error, "status": status}
    return sweep.classify(row) if status != "ok" else row


def test_rows_of_another_architecture_are_named_and_not_counted():
    rows = [_row("llama", "ok"), _row("qwen2", "ok"), _row("minimax", "fail"),
            _row("exaone", "fail", error="UnsupportedConfig: head_dim=32: needs ...")]
    assert rows[2]["status"] == "mlx-lm" and rows[2].get("not_shared")
    assert rows[3]["status"] == "mlx-lm" and not rows[3].get("not_shared")
    lines = sweep.result_lines(rows)
    assert lines[0] == "over every row: ok=2 of 4"
    assert lines[1].startswith("not counted: 1 rows of minimax ")
    assert lines[-1] == "RESULT ok=2 of 3"


def test_a_not_shared_architecture_that_fails_for_another_reason_is_counted():
    """Only the known cause excuses a row: minimax failing in its forward pass is ours."""
    row = _row("minimax", "fail", stage="forward", error="IndexError: list index")
    assert row["status"] == "ours/logits"
    assert not row.get("not_shared")
    assert sweep.result_lines([row])[-1] == "RESULT ok=0 of 1"
