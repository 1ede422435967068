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
