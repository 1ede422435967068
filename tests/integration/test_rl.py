"""The GRPO island (`python -m yeto.rl`): rewards, the GRPO arithmetic, a rollout node
killed mid-run (skipped, then used again when it is back), an island in a run with an
observer node (weights reach the node, staleness and logprob gap logged, held-out
reward measured on the trainer's own weights and never through a node), and the
`yeto demo --rl` run (slow).

Here: the checks through in-process servers, training or the sim (the others:
tests/unit/test_rl.py, tests/e2e/test_rl.py)."""


import threading
import time

from support import wait_until

from yeto.config import IslandConfig
from yeto.rl.grpo import Seq
from yeto.rl.trainer import RLConfig
from yeto.rollout.engine import stop_token_ids
from yeto.rollout.server import RolloutNode, make_server, serve_in_thread
from yeto.rollout.torch_engine import TorchEngine


# ---- the island against real nodes -------------------------------------------------------
def _node(model_dir, adapter=None, request_log=None):
    engine = TorchEngine(model_dir)
    if adapter is not None:
        engine.load_adapter(adapter)
    return RolloutNode(engine, model_name="tiny", request_log=request_log,
                       eos_ids=stop_token_ids(model_dir, engine.tokenizer))


def _configs(model_dir, task, urls, **rl):
    train, held_out = task
    cfg = IslandConfig(model=str(model_dir), data=str(train), eval_data=str(held_out),
                       inner_lr=1e-3, threads=1, device="cpu", seed=0).check()
    return cfg, RLConfig(rollout_url=urls, reward=["reversal_accuracy"], group_size=4,
                         prompts_per_step=4, max_new_tokens=12, eval_prompts=8, **rl)


def test_a_killed_node_is_skipped_and_used_again_when_back(tiny_llama, tiny_task):
    from yeto.rl.run import prepare

    nodes = [_node(tiny_llama), _node(tiny_llama)]
    servers = [serve_in_thread(n) for n in nodes]
    urls = [url + "/v1" for _, url in servers]
    cfg, rl = _configs(tiny_llama, tiny_task, urls, kl_coef=0.05)
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
        trainer.pool.close()
        for (server, _), node in zip(servers, nodes):
            server.shutdown()
            server.server_close()
            node.close()
