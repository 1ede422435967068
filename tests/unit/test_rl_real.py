"""The `number_match` reward and the arithmetic task scripts/rl_real.py trains on
(`yeto.testing.tasks.make_arithmetic_task`)."""

from __future__ import annotations

import json

from yeto.rl.rewards import load_reward, number_match
from yeto.testing.tasks import arithmetic_answer, arithmetic_problems, make_arithmetic_task


def test_number_match():
    assert load_reward("number_match") is number_match
    assert number_match("42", reference="42") == 1.0
    assert number_match(" The answer is 42.", reference="42") == 1.0
    assert number_match("6 * 7 = 42\n\nI'm", reference="42") == 1.0
    assert number_match("6 * 7 = 41", reference="42") == 0.0
    assert number_match("42 is not 43", reference="42") == 0.0  # the last number counts
    assert number_match("1,234", reference="1234") == 1.0
    assert number_match("-3", reference="-3") == 1.0
    assert number_match("3", reference="-3") == 0.0
    assert number_match("4.0", reference="4") == 1.0
    assert number_match("To solve this, we need", reference="7") == 0.0
    assert number_match("7", reference=None) == 0.0
    assert number_match("", reference="7") == 0.0


def test_arithmetic_task_split(tmp_path):
    train, held = make_arithmetic_task(tmp_path)
    rows = {p: [json.loads(x) for x in p.read_text().splitlines()] for p in (train, held)}
    assert len(rows[train]) + len(rows[held]) == len(arithmetic_problems()) == 81 + 64

    def pair(row):
        q = row["messages"][0]["content"].split("?")[0].removeprefix("What is ").split()
        a, op, b = int(q[0]), q[1], int(q[2])
        assert row["messages"][1]["content"] == str(arithmetic_answer(a, op, b))
        return op, min(a, b), max(a, b)

    train_pairs = {pair(r) for r in rows[train]}
    held_pairs = {pair(r) for r in rows[held]}
    assert held_pairs and not train_pairs & held_pairs  # b op a never leaks a held-out a op b
    again, _ = make_arithmetic_task(tmp_path / "again")
    assert again.read_text() == train.read_text()  # the split is fixed by the data seed
