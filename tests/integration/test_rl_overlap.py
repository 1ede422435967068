"""Asynchronous rollouts (`--async-rollouts`, `yeto.rl.overlap`) in a GRPO island
against a real rollout node in this process: the next step's batch is sampled while
the step trains, its staleness is measured against the trainer's version when it is
trained, and a batch over --max-staleness is dropped and drawn again on newer weights.

Here: the checks through in-process servers and training (the sampler's logic alone:
tests/unit/test_rl_overlap.py)."""


import numpy as np
from helpers.rl import rl_configs, serving
from helpers.wait import wait_until

from yeto.rollout.engine import stop_token_ids
from yeto.rollout.server import RolloutNode
from yeto.rollout.torch_engine import TorchEngine


def test_an_async_grpo_island_trains_and_drops_what_is_too_stale(tiny_llama, tiny_task):
    from yeto.rl.run import prepare

    engine = TorchEngine(tiny_llama)
    node = RolloutNode(engine, model_name="tiny",
                       eos_ids=stop_token_ids(tiny_llama, engine.tokenizer))
    with serving(node) as url:
        cfg, rl = rl_configs(tiny_llama, tiny_task, [url + "/v1"], async_rollouts=True,
                           max_staleness=0)
        parts = prepare(cfg, rl)
        _three_async_steps(node, parts.trainer, parts.weights)


def _three_async_steps(node, trainer, weights):
    start = weights.get().copy()
    trainer.sampler.last_step = 3
    try:
        m1 = trainer.step(1, 0)
        assert m1["sample_versions"] == [0] and m1["stale_dropped"] == 0
        # step 2's batch was drawn while step 1 trained: the node served it on version 0
        assert wait_until(lambda: node.scheduler.requests == 2, 120)
        node.scheduler.offer(weights.get().copy(), 1)  # then Θ version 1 reaches the node
        m2 = trainer.step(2, 1)  # one version behind the trainer: over the bound 0
        assert m2["stale_dropped"] == 1 and node.scheduler.requests >= 3
        assert m2["sample_versions"] == [1] and m2["staleness"] == 0  # drawn again, fresh
        m3 = trainer.step(3, 1)  # drawn during step 2, on version 1: kept
        assert m3["stale_dropped"] == 0 and m3["sample_versions"] == [1]
        assert trainer.sampler.dropped == 1 and trainer.sampler.pending_step is None
        trained = [m for m in (m1, m2, m3) if m["tokens"]]
        assert trained and all(np.isfinite(m["loss"]) for m in trained)
        assert not np.array_equal(weights.get(), start)  # the LoRA moved
    finally:
        trainer.sampler.close()
        trainer.pool.close()


def test_the_island_program_runs_async_to_its_last_step(tiny_llama, tiny_task, tmp_path):
    """`yeto rl --async-rollouts` as the program runs it (`run_grpo`, no syncer): every
    step's metrics line says how long it waited for its batch and what it dropped, the
    summary says the mode, and nothing is asked of the node past the last step."""
    import json

    from yeto.rl.run import run_grpo

    engine = TorchEngine(tiny_llama)
    node = RolloutNode(engine, model_name="tiny",
                       eos_ids=stop_token_ids(tiny_llama, engine.tokenizer))
    with serving(node) as url:
        cfg, rl = rl_configs(tiny_llama, tiny_task, [url + "/v1"], async_rollouts=True,
                           eval_prompts=2)
        cfg.max_steps, cfg.output, cfg.progress = 3, tmp_path / "rl", False
        assert run_grpo(cfg, rl) == 0
    summary = json.loads((tmp_path / "rl" / "summary.json").read_text())
    assert summary["async_rollouts"] and summary["stale_dropped"] == 0 and summary["steps"] == 3
    lines = [json.loads(x) for x in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "reward" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["stale_dropped"] == 0 and m["rollout_wait_s"] >= 0 for m in steps)
    assert node.scheduler.requests == 3  # one batch per step, none drawn past step 3
