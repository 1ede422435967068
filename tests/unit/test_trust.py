"""The trust boundary (issue 28): what an island holding a valid credential, a silent
peer, a full disk or an operator's slip can do to a run. One test per failure class,
each through a real gRPC syncer (in this process, or `python -m syncer` where the
process is what fails); each of them failed before the bounds existed.

Here: the checks that need no process, server or training (the others:
tests/integration/test_trust.py, tests/e2e/test_trust.py)."""


import json


def test_tape_lines_are_whole_or_absent(tmp_path):
    from syncer.tape import Tape

    tape = Tape(tmp_path / "tape.jsonl")
    assert tape.write(dict(event="a"))
    tape._file.close()
    tape._file = open(tmp_path / "tape.jsonl", "rb", buffering=0)  # writes now fail
    assert not tape.write(dict(event="b")) and tape.lost == 1
    tape.close()
    assert [json.loads(x) for x in (tmp_path / "tape.jsonl").read_text().splitlines()] == [
        dict(event="a")]


def test_refused_calls_are_taped_at_a_bounded_rate(tmp_path):
    """Every refused call was taped: one peer could write 1.5 GB an hour (issue 44). Now
    a burst per learner, then one a second; the next record counts what was left out."""
    from syncer.tape import Tape, read_tape

    now = [0.0]
    tape = Tape(tmp_path / "tape.jsonl", clock=lambda: now[0])
    written = sum(tape.refusal("rogue", kind="push:invalid", detail="x") for _ in range(1000))
    assert written == Tape.REFUSALS_BURST
    assert tape.refusal("honest", kind="join:denied", detail="y")  # its own allowance
    now[0] += 3 * Tape.REFUSALS_EVERY_S
    assert tape.refusal("rogue", kind="push:invalid", detail="x")
    tape.close()
    rows = read_tape(tmp_path / "tape.jsonl")
    assert len(rows) == Tape.REFUSALS_BURST + 2
    assert rows[-1]["left_out_before"] == 1000 - Tape.REFUSALS_BURST
