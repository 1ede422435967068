"""The GRPO island (`python -m yeto.rl`): rewards, the GRPO arithmetic, a rollout node
killed mid-run (skipped, then used again when it is back), an island in a run with an
observer node (weights reach the node, staleness and logprob gap logged, held-out
reward measured on the trainer's own weights and never through a node), and the
`yeto demo --rl` run (slow).

Here: the checks that need real processes (the others: tests/unit/test_rl.py,
tests/integration/test_rl.py)."""


import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.rl import rl_configs
from helpers.wait import wait_until

from yeto.rollout.engine import stop_token_ids
from yeto.rollout.server import RolloutNode, serve_in_thread
from yeto.rollout.torch_engine import TorchEngine

ROOT = Path(__file__).resolve().parents[2]


# ---- the island against real nodes -------------------------------------------------------
def _node(model_dir, adapter=None, request_log=None):
    engine = TorchEngine(model_dir)
    if adapter is not None:
        engine.load_adapter(adapter)
    return RolloutNode(engine, model_name="tiny", request_log=request_log,
                       eos_ids=stop_token_ids(model_dir, engine.tokenizer))


def test_grpo_island_in_a_run_with_an_observer_node(tiny_llama, tiny_task, tmp_path):
    """The island's pushes reach the node as merged Θ: later samples carry newer
    versions; the gap between the node's and the trainer's logprobs stays tiny when
    the node has the trainer's weights; held-out prompts never reach the node."""
    from syncer.spawn import start_syncer
    from yeto.client import TLSConfig  # noqa: F401 - the observer's client module imports
    from yeto.rl.prompts import load_prompts
    from yeto.rl.run import run_grpo
    from yeto.rollout.observer import Follower, ObserverClient

    log = tmp_path / "requests.jsonl"
    node = _node(tiny_llama, request_log=log)
    server, url = serve_in_thread(node)
    out = tmp_path / "rl"
    with start_syncer(["--quorum", "1"], cwd=ROOT) as syncer:
        client = ObserverClient(syncer.address, "rollout-0", node.engine.layout,
                                backoff_s=0.05, max_backoff_s=0.2)
        node.scheduler.version = -1
        node.follower = Follower(client, node.engine.layout, node.scheduler)
        node.follower.start(node.engine.weights.get())
        cfg, rl = rl_configs(tiny_llama, tiny_task, [url + "/v1"], rollout_wait=60)
        cfg.syncer, cfg.sync_every, cfg.max_steps, cfg.wire = syncer.address, 2, 6, "f32"
        cfg.output, cfg.progress, cfg.blocking_sync = out, False, True
        assert run_grpo(cfg, rl) == 0
        assert wait_until(lambda: node.scheduler.version >= 3, 20)
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "reward" in m]
    assert summary["steps"] == 6 and summary["version"] >= 3 and summary["final"]
    assert summary["reward_before"] is not None and summary["reward_after"] is not None
    assert summary["evals"] >= 4  # before, at each of 3 syncs, after
    versions = [v for m in steps for v in m["sample_versions"]]
    # the first samples come from the initial weights: Θ version 0, or the node's own
    # before that broadcast reached it (-1; LoRA at init, B = 0: the same function);
    # merged Θ reached the node later
    assert versions[0] in (-1, 0) and max(versions) >= 2 and versions == sorted(versions)
    assert all(m["staleness"] is not None and m["staleness"] <= 1 for m in steps)
    # right after a (blocking) sync the node holds exactly the trainer's weights: its
    # logprobs are the trainer's; a step later the trainer has moved on by one step
    fresh = [m for m in steps if (m["step"] - 1) % 2 == 0 and m["staleness"] == 0]
    assert fresh and all(m["logprob_gap"] < 1e-4 for m in fresh)
    assert any(m["logprob_gap"] > 1e-3 for m in steps if m["step"] % 2 == 0)
    tok = node.tokenizer
    held = {p.ids for p in load_prompts(str(tiny_task[1]), tok)[0]}
    sent = [tuple(p) for line in log.read_text().splitlines() for p in json.loads(line)["prompts"]]
    assert sent and not held.intersection(sent)
    server.shutdown()
    node.close()


# `yeto rl`; the MLX island with torch and peft unimportable (`pip install "yeto[mlx]"`)
LAUNCH = {"torch": ["-m", "yeto", "rl"],
          "mlx": ["-c", "import sys, runpy\n"
                        "for m in ('torch', 'peft'): sys.modules[m] = None\n"
                        "sys.argv = ['yeto', 'rl', *sys.argv[1:]]\n"
                        "runpy.run_module('yeto', run_name='__main__')\n"]}


@pytest.mark.slow
@pytest.mark.regimes
@pytest.mark.mlx
def test_a_torch_and_an_mlx_grpo_island_in_one_run(tiny_llama, tiny_task, tmp_path):
    """Mixed fleet: `yeto rl --backend torch` and `yeto rl --backend mlx` (without torch)
    as processes, one syncer (quorum 2), one rollout node: every round merges both
    islands' pushes, and both end holding the syncer's final adapter bit for bit."""
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'yeto[mlx]')")
    from helpers.wait import run_together
    from safetensors.numpy import load_file

    from syncer.spawn import start_syncer

    node = _node(tiny_llama)
    server, url = serve_in_thread(node)
    train, held_out = tiny_task
    try:
        with start_syncer(["--quorum", "2", "--state-dir", str(tmp_path / "s")],
                          cwd=ROOT) as syncer:
            runs = run_together(*[
                [*LAUNCH[backend], "--backend", backend, "--model", tiny_llama,
                 "--data", train, "--eval-data", held_out, "--syncer", syncer.address,
                 "--learner-id", f"grpo-{backend}", "--learner-index", i, "--num-learners", 2,
                 "--rollout-url", url + "/v1", "--max-steps", 4, "--sync-every", 2,
                 "--group-size", 4, "--prompts-per-step", 4, "--max-new-tokens", 12,
                 "--eval-prompts", 4, "--wire", "f32", "--threads", 1, "--no-progress",
                 "--output", tmp_path / backend]
                for i, backend in enumerate(("torch", "mlx"))], cwd=ROOT, timeout=600)
            for r in runs:
                assert r.returncode == 0, r.stderr[-3000:]
    finally:
        server.shutdown()
        server.server_close()
        node.close()
    final = load_file(str(tmp_path / "s" / "final" / "adapter_model.safetensors"))
    for backend in ("torch", "mlx"):
        s = json.loads((tmp_path / backend / "summary.json").read_text())
        assert s["final"] and s["pushes"] == 2 and s["version"] >= 2, (backend, s)
        mine = load_file(str(tmp_path / backend / "adapter" / "adapter_model.safetensors"))
        assert mine.keys() == final.keys(), backend
        assert all(np.array_equal(mine[k], final[k]) for k in mine), backend
    tape = [json.loads(line) for line in (tmp_path / "s" / "tape.jsonl").open()]
    merges = [t for t in tape if "responders" in t]
    assert merges and all({r["learner"] for r in t["responders"]} ==
                          {"grpo-torch", "grpo-mlx"} for t in merges), merges


@pytest.mark.slow
@pytest.mark.regimes  # the default outer rule must keep RL learning (issue 43)
@pytest.mark.mlx
@pytest.mark.parametrize("nodes,trainer", [("torch,mlx", "torch"), ("direct", "torch"),
                                           ("torch,mlx", "mlx")])  # torch,mlx: observer nodes
def test_demo_rl_reward_rises(tmp_path, nodes, trainer):
    out = tmp_path / "demo-rl"
    r = subprocess.run([sys.executable, "-m", "yeto", "demo", "--rl", "--nodes", nodes,
                        "--trainer", trainer, "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["reward_after"] > s["reward_before"] + 0.05, s
    assert s["trainer"] == trainer
    assert s["held_out_prompts_sent_to_nodes"] == 0
    assert s["eval_via"].startswith("trainer")
    assert {n["backend"] for n in s["nodes"]} == {"torch", "mlx"}
    assert all(n["version"] >= 1 and n["requests"] > 0 for n in s["nodes"])
    for key in ("steps", "seconds", "sync_every"):
        assert s[key]
    assert "held-out reward" in r.stdout
    if nodes == "direct":  # every node got the trainer's last adapter
        assert s["node_lag"] == [0, 0], s["node_lag"]
        steps = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").open()
                 if '"node_lag"' in line]
        assert len(steps) == s["steps"]  # each step says how far behind each node is
        assert all(0 <= lag <= 1 for m in steps for lag in m["node_lag"].values())
