"""The GRPO island (`python -m yeto.rl`): rewards, the GRPO arithmetic, a rollout node
killed mid-run (skipped, then used again when it is back), an island in a run with an
observer node (weights reach the node, staleness and logprob gap logged, held-out
reward measured on the trainer's own weights and never through a node), and the
`yeto demo --rl` run (slow).

Here: the checks through in-process servers, training or the sim (the others:
tests/unit/test_rl.py, tests/e2e/test_rl.py)."""


import json
import threading
import time

import numpy as np
import pytest
from helpers.rl import rl_configs
from helpers.wait import wait_until

from yeto.rl.grpo import Seq
from yeto.rollout.engine import stop_token_ids
from yeto.rollout.server import RolloutNode, make_server, serve_in_thread
from yeto.rollout.torch_engine import TorchEngine


# ---- the island against real nodes -------------------------------------------------------
def _node(model_dir, adapter=None, request_log=None, adapter_roots=None):
    engine = TorchEngine(model_dir)
    if adapter is not None:
        engine.load_adapter(adapter)
    return RolloutNode(engine, model_name="tiny", request_log=request_log,
                       eos_ids=stop_token_ids(model_dir, engine.tokenizer),
                       adapter_roots=adapter_roots)


def _close(trainer, servers, nodes) -> None:
    trainer.pool.close()
    for (server, _), node in zip(servers, nodes):
        server.shutdown()
        server.server_close()
        node.close()


def test_a_killed_node_is_skipped_and_used_again_when_back(tiny_llama, tiny_task):
    from yeto.rl.run import prepare

    nodes = [_node(tiny_llama), _node(tiny_llama)]
    servers = [serve_in_thread(n) for n in nodes]
    urls = [url + "/v1" for _, url in servers]
    cfg, rl = rl_configs(tiny_llama, tiny_task, urls, kl_coef=0.05)
    parts = prepare(cfg, rl)
    trainer = parts.trainer
    trainer.pool.retry_s = 0.2
    try:
        trainer.step(1, -1)
        assert all(n.scheduler.requests == 1 for n in nodes)  # groups round-robined
        server, _ = servers[1]
        host, port = server.server_address[:2]
        server.shutdown()
        server.server_close()  # the node is gone: connection refused
        for step in (2, 3):
            m = trainer.step(step, -1)  # the run goes on with the other node
            assert len(m["sample_versions"]) == 1
        report = {r["url"]: r for r in trainer.pool.report()}
        assert report[urls[1][:-3]]["failures"] >= 1 and nodes[1].scheduler.requests == 1
        assert report[urls[0][:-3]]["groups"] == 2 + 4 + 4  # every group of steps 2, 3
        back = make_server(nodes[1], host, port)  # restarted on the same address
        threading.Thread(target=back.serve_forever, daemon=True).start()
        servers[1] = (back, urls[1])
        assert wait_until(lambda: trainer.pool.nodes[1].up(time.monotonic()), 120)
        trainer.step(4, -1)
        assert nodes[1].scheduler.requests == 2  # used again
        assert {r["url"]: r for r in trainer.pool.report()}[urls[1][:-3]]["groups"] == 4
        seqs = [Seq(trainer.prompts[0].ids, [5, 6, 7], [-1.0] * 3, 1.0, 0),
                Seq(trainer.prompts[0].ids, [8, 9], [-1.0] * 2, -1.0, 0)]
        trainer._train(seqs, 5)
        assert trainer._train(seqs, 6)["kl"] > 0  # --kl-coef: the LoRA moved off the base
    finally:
        _close(trainer, servers, nodes)


def _ignoring(node, keeps_name: bool):
    """A reload that says ok and loads nothing: the node then refuses the adapter's
    name, or (`keeps_name`) takes it and samples its old weights under it."""
    def reload(body):
        if keeps_name:
            node.ctx.aliases = (*node.base_aliases, body["lora_name"])
        return {"status": "ok"}
    return reload


@pytest.mark.parametrize("keeps_name", [False, True])
def test_the_trainer_keeps_nodes_current_and_skips_one_that_ignores_reloads(
        tiny_llama, tiny_task, tmp_path, keeps_name):
    """--update-nodes: nodes that do not observe the syncer get the trainer's adapter
    (POST /v1/load_lora_adapter, then sampled by its lora_name); a node that answers
    the reload but keeps its old weights is reported and skipped after two updates."""
    from yeto.rl.run import prepare

    folder = tmp_path / "node-adapters"
    nodes = [_node(tiny_llama, adapter_roots=[tmp_path]) for _ in range(2)]
    deaf = nodes[1]
    deaf.reload = _ignoring(deaf, keeps_name)
    servers = [serve_in_thread(n) for n in nodes]
    cfg, rl = rl_configs(tiny_llama, tiny_task, [url + "/v1" for _, url in servers],
                       update_nodes=True, node_adapter_dir=folder)
    parts = prepare(cfg, rl)
    trainer, updater = parts.trainer, parts.updater
    trainer.pool.retry_s = 0.0  # a refusing node is asked again at the next step
    try:
        for step in range(1, 7):
            if step % 2 == 1:
                updater.update(step - 1)
            trainer.step(step, -1)
        good, ignored = trainer.pool.nodes
        assert nodes[0].scheduler.version == updater.updates == 3  # every update loaded
        assert nodes[0].ctx.aliases[-1] == good.model == "yeto-step-4"
        assert (folder / "step-4" / "adapter" / "adapter_model.safetensors").is_file()
        assert good.served == good.wanted == 3 and not good.stale
        # told twice, still on its old weights (version 0; or refusing the name: no
        # answer at all, -1): skipped before the third update
        assert ignored.stale and ignored.wanted == 2 and deaf.scheduler.version == 0
        assert ignored.served == (0 if keeps_name else -1)
        report = {r["url"]: r for r in trainer.pool.report()}
        assert report[ignored.url]["stale"] and report[ignored.url]["lag"] > 0
        assert report[good.url]["lag"] == 0
        groups = good.groups
        trainer.step(7, -1)  # the ignored node is no longer asked
        assert good.groups == groups + rl.prompts_per_step
    finally:
        _close(trainer, servers, nodes)



@pytest.mark.mlx
def test_the_mlx_grpo_island_joins_pushes_and_takes_theta(tiny_llama, tiny_task, tmp_path):
    """`yeto rl --backend mlx` on the island machinery: it joins a real syncer, pushes at
    every sync, takes each merged Θ, and ends holding the syncer's final Θ exactly."""
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'yeto[mlx]')")
    import torch
    from helpers.syncer import running_syncer
    from safetensors.numpy import load_file

    from yeto.rl.run import run_grpo

    torch.set_num_threads(1)  # the node's, as a torch trainer in this process sets it
    node = _node(tiny_llama)
    server, url = serve_in_thread(node)
    out = tmp_path / "rl"
    try:
        with running_syncer(quorum=1, state_dir=tmp_path / "s") as (run, address):
            cfg, rl = rl_configs(tiny_llama, tiny_task, [url + "/v1"], backend="mlx",
                               eval_prompts=2)
            cfg.syncer, cfg.sync_every, cfg.max_steps, cfg.wire = address, 1, 2, "f32"
            cfg.output, cfg.progress, cfg.blocking_sync = out, False, True
            assert run_grpo(cfg, rl) == 0
            theta = run.theta.copy()
    finally:
        server.shutdown()
        server.server_close()
        node.close()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final"] and summary["pushes"] == 2 and summary["version"] >= 2
    assert json.loads((out / "provenance.json").read_text())["backend"] == "mlx-grpo"
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert [m["version"] for m in steps] == [1, 2] and all(m["tokens"] > 0 for m in steps)
    mine = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    final = load_file(str(tmp_path / "s" / "final" / "adapter_model.safetensors"))
    assert mine.keys() == final.keys() and all(np.array_equal(mine[k], final[k]) for k in mine)
    assert np.array_equal(np.concatenate([final[s.name].ravel() for s in node.engine.layout.specs]),
                          theta)
