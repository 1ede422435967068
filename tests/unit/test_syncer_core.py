"""The syncer's parts without a network: merge rules, defaults, state files, signals,
and the size of its functions."""

import json
import re
import signal
import threading
from pathlib import Path

import numpy as np
import pytest

from syncer import __main__ as syncer_cli
from syncer import state
from syncer.merge import MergeAccumulator
from syncer.run import Config, Run
from syncer.staging import WholePush
from yeto import codec

ROOT = Path(__file__).resolve().parents[2]
N = 64


def _deltas(k, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(N).astype(np.float32) for _ in range(k)]


def _merge(rule, pushes, clip_factor=0.0):
    acc = MergeAccumulator(N, rule, clip_factor)
    weights = [acc.add(codec.encode(d, "f32"), "f32", t).weight for d, t in pushes]
    return acc, weights, acc.result().copy()


# ---- merge rules ------------------------------------------------------------------------
def test_token_weighted_mean_matches_hand_computation():
    d = _deltas(3)
    tokens = [10, 30, 60]
    acc, weights, g = _merge("mean", list(zip(d, tokens)))
    want = sum(t * x.astype(np.float64) for x, t in zip(d, tokens)) / sum(tokens)
    np.testing.assert_allclose(g, want, atol=1e-6)
    assert weights == [10.0, 30.0, 60.0] and not acc.uniform_fallback


@pytest.mark.parametrize("rule", ["mean", "rda"])
@pytest.mark.parametrize("clip_factor", [0.0, 100.0])
def test_a_round_whose_pushes_all_carry_zero_tokens_falls_back_to_uniform(rule, clip_factor):
    d = _deltas(3)
    acc, weights, g = _merge(rule, [(x, 0) for x in d], clip_factor)
    assert acc.uniform_fallback and weights == [0.0, 0.0, 0.0]
    assert [acc.merged_weight(w) for w in weights] == [1.0, 1.0, 1.0]
    # what the same pushes give with one token each, i.e. equal weights
    expected = np.mean(d, axis=0) if rule == "mean" else _merge("rda", [(x, 1) for x in d])[2]
    np.testing.assert_allclose(g, expected, atol=1e-6)


@pytest.mark.parametrize("rule", ["mean", "rda"])
@pytest.mark.parametrize("order", ["zero_first", "zero_last", "zero_between"])
def test_zero_token_pushes_get_no_weight_next_to_counted_ones(rule, order):
    d = _deltas(3)
    zero = (d[0], 0)
    counted = [(d[1], 20), (d[2], 60)]
    pushes = {"zero_first": [zero, *counted], "zero_last": [*counted, zero],
              "zero_between": [counted[0], zero, counted[1]]}[order]
    acc, _, g = _merge(rule, pushes)
    _, _, without = _merge(rule, counted)
    assert not acc.uniform_fallback and acc.merged_weight(0.0) == 0.0
    np.testing.assert_allclose(g, without, atol=1e-6)


def test_rejected_payload_leaves_the_accumulator_untouched():
    acc = MergeAccumulator(N, "mean")
    acc.add(codec.encode(_deltas(1)[0], "f32"), "f32", 0)  # a zero-token push is summed
    before = (acc.sum.copy(), acc.total_weight, acc.count)
    bad = bytearray(codec.encode(np.ones(N, np.float32), "f32"))
    bad[-4:] = np.array([np.nan], np.float32).tobytes()
    with pytest.raises(codec.CodecError):
        acc.add(bytes(bad), "f32", 50)  # would have cleared the zero-token sum
    assert acc.sum.tobytes() == before[0].tobytes()
    assert (acc.total_weight, acc.count) == before[1:]


# ---- defaults agree everywhere ----------------------------------------------------------
def test_library_defaults_equal_the_cli_defaults():
    args = syncer_cli.build_parser().parse_args([])
    assert syncer_cli.config_from_args(args) == Config()
    assert (args.outer, args.outer_lr, args.outer_momentum) == ("auto", 0.4, 0.9)
    run = Run(Config())
    assert (run.outer.name, run.outer.lr, run.outer.momentum) == ("auto", 0.4, 0.9)
    run.tape.close()


def _docs_syncer_defaults() -> dict[str, str]:
    """`flag -> default` from the syncer flag table of docs/how-it-works.md."""
    lines = (ROOT / "docs" / "how-it-works.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| syncer flag"))
    out = {}
    for line in lines[start + 2:]:
        if line.strip() and not line.startswith("|"):
            break  # the table ends at the first line of prose (blank lines are tolerated)
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) < 2:
            continue
        flags = re.findall(r"`(--[a-z-]+)", cells[0])
        defaults = [v.strip().split()[0] for v in cells[1].split(",")]
        if len(flags) == len(defaults):
            out.update(zip(flags, defaults))
    return out


def test_the_docs_state_the_cli_defaults():
    readme = _docs_syncer_defaults()
    assert {"--outer-lr", "--outer-momentum", "--grace-ms", "--quorum"} <= set(readme)
    parser = syncer_cli.build_parser()
    defaults = {a.option_strings[0]: a.default for a in parser._actions if a.option_strings}
    for flag, stated in readme.items():
        actual = defaults[flag]
        if stated == "none":
            assert actual is None, flag
        elif isinstance(actual, (int, float)) and not isinstance(actual, bool):
            assert float(stated) == float(actual), flag
        else:
            assert stated == str(actual), flag


# ---- state files ------------------------------------------------------------------------
def _meta():
    return dict(run_id="r", version=3)


def test_state_round_trip_with_the_islands_weights(tmp_path):
    theta, m = np.arange(N, dtype=np.float32), np.ones(N, np.float32)
    island = theta + 0.5
    state.save(tmp_path, theta, m, island, _meta())
    t2, m2, i2, meta = state.load(tmp_path)
    assert t2.tobytes() == theta.tobytes() and m2.tobytes() == m.tobytes()
    assert i2.tobytes() == island.tobytes() and meta["version"] == 3
    state.save(tmp_path, theta, m, theta.copy(), _meta())  # equal to Θ: not stored
    assert state.load(tmp_path)[2] is None
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))


def test_a_state_saved_before_the_metadata_digest_resumes(tmp_path):
    """Format 1 (the main of 2026-12-01): no metadata digest, no --outer flag; it
    resumes as plain Nesterov."""
    from safetensors.numpy import save_file

    from yeto.layout import Layout

    layout = Layout.from_shapes({"a.lora_A.weight": (N,)})
    theta = np.arange(N, dtype=np.float32)
    flags = dict(outer_lr=1.0, outer_momentum=0.0, merge="mean", clip_factor=0.0,
                 downlink="f32", fragments=1)
    meta = dict(run_id="old", version=4, round=4, fragment_versions=[4], format=1,
                fingerprint=layout.fingerprint, layout=[["a.lora_A.weight", [N], "float32"]],
                flags=flags, weights_file="w.safetensors", export_files={}, bytes_in=0,
                bytes_out=0, islands={"x": dict(backend="numpy", pushes=4, loss_tokens=40,
                                                last_seq=3)},
                theta_sha256=state.digest(theta))
    save_file({"theta": theta}, str(tmp_path / state.STATE_FILE),
              metadata={"yeto_state": json.dumps(meta)})
    # its flags, passed as the message of a changed default asks (plain averaging)
    run = Run(Config(state_dir=tmp_path, resume=True, outer="nesterov", outer_lr=1.0,
                     outer_momentum=0.0))
    assert run.version == 4 and run.theta.tobytes() == theta.tobytes()
    assert run.members.rows["x"].last_seq == 3 and run.outer.name == "nesterov"
    run.tape.close()


def test_provenance_command_hides_the_token():
    argv = ["python", "-m", "syncer", "--token", "s3cret", "--quorum", "2", "--token=x2"]
    assert state.redact_command(argv, ("token", "tls_key")) == [
        "python", "-m", "syncer", "--token", "<redacted>", "--quorum", "2",
        "--token=<redacted>"]


# ---- signals ----------------------------------------------------------------------------
class _StopRecorder:
    """A server whose clean stop gets two signals: the first must be taken as the clean
    stop already under way, the second must stop at once."""

    def __init__(self):
        self.ticker_stop = threading.Event()
        self.graces = []

    def stop(self, grace):
        self.graces.append(grace)
        if grace > 0:
            signal.raise_signal(signal.SIGTERM)  # first: noted, the clean stop goes on
            self.graces.append("first signal taken")
            signal.raise_signal(signal.SIGTERM)  # second: KeyboardInterrupt from here
            self.graces.append("not reached")
        done = threading.Event()
        done.set()
        return done


def test_second_signal_stops_the_syncer_at_once():
    run = Run(Config())
    run.finished = True  # nothing to wait for: straight to the clean stop
    server = _StopRecorder()
    before = signal.getsignal(signal.SIGTERM)
    assert syncer_cli._serve_until_done(run, server, None) == 130
    assert server.graces == [2.0, "first signal taken", 0.0]
    assert server.ticker_stop.is_set()
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored


def test_expected_islands_are_listed_as_reserved_until_they_join():
    """`--expect-islands` (yeto launch's external slots): the status lists them."""
    from syncer.run import Config, Run
    from yeto.layout import TensorSpec

    run = Run(Config(quorum=2, expect_islands=("island-1",)))
    rows = {r["learner_id"]: r["state"] for r in run.status()["islands"]}
    assert rows == {"island-1": "reserved"}
    specs = [TensorSpec("a.weight", (4,), "float32")]
    from yeto.layout import fingerprint

    run.join("island-1", specs, fingerprint(specs), "torch", "w.safetensors", {})
    rows = {r["learner_id"]: r["state"] for r in run.status()["islands"]}
    assert rows == {"island-1": "waiting"}


def test_final_weights_count_as_delivered_when_the_island_hangs_up_at_the_last_chunk():
    """An island that has its final weights closes its stream at once; the syncer's
    stream could be closed at its last `yield` before recording the delivery, and the
    syncer then waited out its whole final drain for an island long gone."""
    from syncer.broadcast import Subscription
    from syncer.messages import PushHeader
    from yeto.layout import Layout

    layout = Layout.from_shapes({"a.lora_A.weight": (N,)})
    run = Run(Config(quorum=1))
    gen = run.join("x", layout.specs, layout.fingerprint, "numpy", "w.safetensors",
                   {})["generation"]
    run.push(PushHeader("x", gen, 0, 0, 0, 0, 0, "f32", N, 4 * N, True, 0),
             WholePush(codec.encode(np.zeros(N, np.float32), "f32")))
    assert run.finish_island("x", gen) and not run.final_done()
    sub = Subscription(run, "x", gen)
    stream = sub.send(sub.wait_next(lambda: True))
    assert next(stream)  # 64 weights are one chunk: the stream is parked at its last yield
    assert not sub.all_finals_sent()
    stream.close()  # the transport drops the stream: the island hung up
    assert sub.all_finals_sent()
    run.tape.close()


def test_a_port_or_quorum_out_of_range_is_one_clear_error(capsys):
    """--port 70000 silently became 4464 and --quorum 2^32 ended in a traceback (issue 44)."""
    for argv, said in ((["--port", "70000"], "out of range: use 0"),
                       (["--dashboard-port", "-1"], "out of range"),
                       (["--port", "x"], "not a port number")):
        with pytest.raises(SystemExit) as e:
            syncer_cli.build_parser().parse_args(argv)
        assert e.value.code == 2 and said in capsys.readouterr().err
    with pytest.raises(ValueError, match="--quorum must be 1 to"):
        Config(quorum=1 << 32).check()
