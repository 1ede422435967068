"""Sharded runs without processes: shards in-process, fed the same pushes as one
unsharded run; `yeto export` assembles the run's adapter from every shard's state dir,
bit for bit the unsharded run's (the process tests: tests/e2e/test_shards.py)."""

from __future__ import annotations

import contextlib
import json
import socket

import numpy as np
import pytest
from helpers.syncer import running_syncer
from helpers.wait import wait_until
from safetensors.numpy import load_file

from syncer.run import Config, PushHeader, Reject, Run
from syncer.shards import Shard
from syncer.staging import WholePush
from yeto import codec
from yeto.cli import status as status_cli
from yeto.client.sharded import ShardedClient
from yeto.interop.export import ExportError, export
from yeto.layout import Layout

LAYOUT = Layout.from_shapes({"base_model.model.m.q_proj.lora_A.weight": (2, 8),
                             "base_model.model.m.q_proj.lora_B.weight": (8, 2),
                             "base_model.model.m.v_proj.lora_A.weight": (2, 8),
                             "base_model.model.m.v_proj.lora_B.weight": (8, 2)})
CONFIG = json.dumps(dict(peft_type="LORA", r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                         base_model_name_or_path="m", task_type="CAUSAL_LM"))


def _run(state_dir, shard: Shard) -> tuple[Run, int]:
    run = Run(Config(quorum=1, fragments=2, state_dir=state_dir, shard=shard))
    gen = run.join("a", LAYOUT.specs, LAYOUT.fingerprint, "numpy", "adapter_model.safetensors",
                   {"adapter_config.json": CONFIG})["generation"]
    n = LAYOUT.numel
    seed = np.random.default_rng(0).standard_normal(n).astype(np.float32) * 0.1
    run.push(PushHeader("a", gen, 0, 0, 0, 0, 0, "f32", n, 4 * n, True, 0),
             WholePush(codec.encode(seed, "f32")))
    return run, gen


def _push(run: Run, gen: int, f: int, seq: int, base: int) -> None:
    numel = run.model.numel(f)
    delta = np.random.default_rng(100 + seq).standard_normal(numel).astype(np.float32) * 0.01
    reply = run.push(PushHeader("a", gen, base + 1, f, base, 10, 1, "q4", numel,
                                codec.encoded_size("q4", numel), False, seq),
                     WholePush(codec.encode(delta, "q4")))
    assert reply["accepted"], reply


def test_shards_exported_together_are_the_unsharded_run_bit_for_bit(tmp_path):
    one, gen1 = _run(tmp_path / "one", Shard())
    shards = [_run(tmp_path / f"s{i}", Shard(i, 2)) for i in range(2)]
    seq = 0
    for _ in range(3):  # three rounds of each fragment, in the same order everywhere
        for f in range(2):
            seq += 1
            _push(one, gen1, f, seq, one.committer.fragment_version(f))
            run, gen = shards[f]  # fragment f is shard f's (equal sizes: dealt in order)
            _push(run, gen, f, seq, run.committer.fragment_version(f))
    for run, _ in [(one, 0), *shards]:
        run.tape.close()
    # a shard refuses a push to another's fragment, naming its owner
    run, gen = shards[0]
    with pytest.raises(Reject, match="belongs to shard 1"):
        run.push(PushHeader("a", gen, run.version + 1, 1, run.version, 10, 1, "q4",
                            run.model.numel(1), codec.encoded_size("q4", run.model.numel(1)),
                            False, 99), WholePush(b""))
    export([tmp_path / "one"], tmp_path / "out1", "peft")
    export([tmp_path / "s0", tmp_path / "s1"], tmp_path / "out2", "peft")
    a = load_file(tmp_path / "out1" / "adapter_model.safetensors")
    b = load_file(tmp_path / "out2" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)
    # the shards' own states differ from it where they do not own the fragment
    assert not np.array_equal(shards[0][0].theta, one.theta)
    with pytest.raises(ExportError, match="shards 0/2"):
        export([tmp_path / "s0", tmp_path / "s0"], tmp_path / "out3", "peft")


def _two_shards_pushed_to(stack: contextlib.ExitStack, tmp_path, **served_by
                          ) -> list[tuple[Run, str]]:
    """Two served shards (`running_syncer`, quorum 1, shard f owning fragment f), seeded
    by island "a", which pushed once to shard 0 and twice to shard 1."""
    served = [stack.enter_context(running_syncer(quorum=1, fragments=2, shard=Shard(i, 2),
                                                 state_dir=tmp_path / f"s{i}", **served_by))
              for i in range(2)]
    for f, (run, _) in enumerate(served):
        gen = run.join("a", LAYOUT.specs, LAYOUT.fingerprint, "numpy",
                       "adapter_model.safetensors", {"adapter_config.json": CONFIG},
                       )["generation"]
        n = LAYOUT.numel
        run.push(PushHeader("a", gen, 0, 0, 0, 0, 0, "f32", n, 4 * n, True, 0),
                 WholePush(codec.encode(np.zeros(n, np.float32), "f32")))
        for seq in range(f + 1):
            _push(run, gen, f, seq, run.committer.fragment_version(f))
    return served


def test_status_shows_every_shard_and_each_island_over_all_of_them(tmp_path, capsys):
    """`yeto status 'A;B'`: a line per shard (its round, version, bytes), each island
    once with its pushes summed over the shards; the shards listed out of order, or one
    shard alone, are said as such."""
    with contextlib.ExitStack() as stack:
        served = _two_shards_pushed_to(stack, tmp_path)
        a, b = (address for _, address in served)
        assert status_cli.main([f"{a};{b}", "--json"]) == 0
        s = json.loads(capsys.readouterr().out)
        assert [(x["shard"], x["shards"], x["address"], x["version"]) for x in s["shards"]] == [
            (0, 2, a, 1), (1, 2, b, 2)]
        assert status_cli.main([f"{a};{b}"]) == 0
        text = capsys.readouterr().out
        assert f"shard 0/2 {a}" in text and f"shard 1/2 {b}" in text
        row = next(line.split() for line in text.splitlines() if line.split()[:1] == ["a"])
        assert row[-2:] == ["3", "10"], text  # 1 + 2 pushes; loss tokens where fragment 0 is
        assert "expected shard" not in text
        assert status_cli.main([f"{b};{a}"]) == 0
        assert "expected shard 0 of 2 here" in capsys.readouterr().out
        assert status_cli.main([b]) == 0
        assert "shard 1 of 2: its fragments only" in capsys.readouterr().out


def test_one_dashboard_shows_every_shard_and_each_island_over_all_of_them(tmp_path):
    """A shard's dashboard given every shard's address (--dashboard-shards) shows each
    shard's version and each island once over all of them; a shard that does not answer
    is a row saying so (each shard's own dashboard showed only its part before)."""
    from helpers.status_dashboard import http_get

    from syncer.dashboard import ShardView, start_dashboard

    with contextlib.ExitStack() as stack:
        served = _two_shards_pushed_to(stack, tmp_path, token="s3cret", secret="s3cret")
        addresses = [address for _, address in served]
        with socket.socket() as closed:  # a third address nobody answers at
            closed.bind(("127.0.0.1", 0))
            silent = f"127.0.0.1:{closed.getsockname()[1]}"
        # the page's own shard answered in-process ("self": `yeto launch` starts it last)
        dash = start_dashboard(served[0][0], token="s3cret",
                               shards=ShardView(["self", addresses[1], silent], "s3cret", None,
                                                own=(0, served[0][0].status)))
        try:
            s = json.loads(http_get(dash.url + "api/status?token=s3cret")[2])
        finally:
            dash.stop()
        assert [(x["position"], x.get("shard"), x["address"], x.get("version"))
                for x in s["shard_rows"][:2]] == [(0, 0, "this syncer", 1), (1, 1, addresses[1], 2)]
        assert s["shard_rows"][2]["address"] == silent
        assert "UNAVAILABLE" in s["shard_rows"][2]["error"]
        (row,) = s["run_islands"]
        assert (row["learner_id"], row["pushes"], row["loss_tokens"]) == ("a", 3, 10)
        assert s["version"] == 1  # the page's own shard, as before


def test_a_shard_keeps_only_its_own_fragments(tmp_path):
    """Each shard held all of Θ (and, under a compressed downlink, the islands' copy):
    S shards took S times the memory. Now a shard keeps its own fragments' values; the
    others' stay zero pages that are never written (scripts/bench_shards.py measures the
    memory: BENCHMARKS.md)."""
    for shard in (Shard(0, 2), Shard(1, 2)):
        run, _ = _run(tmp_path / f"s{shard.index}", shard)
        seed = np.random.default_rng(0).standard_normal(LAYOUT.numel).astype(np.float32) * 0.1
        (mine,) = run.owned()
        for f in range(2):
            lo, hi = run.model.span(f)
            want = seed[lo:hi] if f == mine else np.zeros(hi - lo, np.float32)
            np.testing.assert_array_equal(run.theta[lo:hi], want, err_msg=f"fragment {f}")
        run.tape.close()


def test_an_island_knows_the_fragments_from_whichever_shard_answers_first(tmp_path):
    """The island took the run's fragment count from shard 0 alone: when shard 1
    answered first (here shard 0 is not up yet), it counted one fragment, and shard 1's
    broadcast of fragment 1 crashed it (`IndexError`, seen in `yeto launch --shards
    2`). Now any shard that answered tells it."""
    with socket.socket() as s:  # a port where shard 0 is not (yet) listening
        s.bind(("127.0.0.1", 0))
        down = s.getsockname()[1]
    with running_syncer(quorum=1, fragments=2, shard=Shard(1, 2),
                        state_dir=tmp_path / "s1") as (_, address):
        client = ShardedClient(f"127.0.0.1:{down};{address}", "a", LAYOUT,
                               backoff_s=0.05, max_backoff_s=0.2)
        try:
            client.start(np.zeros(LAYOUT.numel, np.float32))
            assert wait_until(lambda: client.clients[1].connected.is_set(), timeout=30)
            assert client.num_fragments == 2
        finally:
            client.close()
