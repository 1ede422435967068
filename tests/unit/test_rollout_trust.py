"""A rollout node's trust boundary (issue 28): it answers no web page (Host, Origin,
Content-Type), bounds the rows of a request by --max-batch, refuses non-finite or
out-of-range sampling settings, refuses broken adapters while the old one keeps
serving, and loads adapters only from under its adapter roots. Every refusal is a
JSON error that says what to do, and the node keeps serving.

Here: the checks that need no process, server or training (the others:
tests/integration/test_rollout_trust.py)."""


from pathlib import Path

from yeto.rollout.cli import adapter_roots, build_parser
from yeto.rollout.guard import Guard


def test_host_rules_beyond_loopback():
    wild = Guard.for_bind("0.0.0.0", 8080)
    assert wild.own("10.1.2.3") and wild.own("127.0.0.1") and wild.own("localhost")
    assert not wild.own("evil.example")
    named = Guard.for_bind("127.0.0.1", 8080, ["Rollout.internal"])
    assert named.own("rollout.internal") and not named.own("10.1.2.3")
    assert Guard.for_bind("127.0.0.1", 8080, ["*"]).own("anything.example")


def test_default_adapter_roots_are_the_working_dir_and_the_adapters_dir(tmp_path):
    args = build_parser().parse_args(["--model", "m", "--adapter", str(tmp_path / "a")])
    assert adapter_roots(args) == [Path.cwd(), tmp_path.resolve()]
    args = build_parser().parse_args(["--model", "m", "--adapter-root", "/srv/x"])
    assert adapter_roots(args) == [Path("/srv/x")]
    assert "--adapter-root" in build_parser().format_help()
