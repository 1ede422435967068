"""What the rl tests in more than one tier share."""

from contextlib import contextmanager

from yeto.config import IslandConfig
from yeto.rl.trainer import RLConfig


def rl_configs(model_dir, task, urls, **rl):
    train, held_out = task
    cfg = IslandConfig(model=str(model_dir), data=str(train), eval_data=str(held_out),
                       inner_lr=1e-3, threads=1, device="cpu", seed=0).check()
    rl = dict(dict(group_size=4, prompts_per_step=4, max_new_tokens=12, eval_prompts=8), **rl)
    return cfg, RLConfig(rollout_url=urls, reward=["reversal_accuracy"], **rl)


def grpo_policies(model_dir, kl_coef=0.0, clip_eps=0.2, lr=1e-3):
    """The torch and the MLX GRPO trainer's backend part (`yeto.rl.trainer.Policy`) on
    `model_dir`, holding the same random, non-zero LoRA weights; each has `.flat()`,
    its LoRA weights as one vector in `.layout`'s order."""
    import numpy as np

    from yeto.data.models import resolve_model
    from yeto.rl.run import island_backend, policy_of

    cfg = IslandConfig(model=str(model_dir), data="-", lora_r=4, lora_alpha=8.0,
                       inner_lr=lr, threads=1, device="cpu", seed=0).check()
    source = resolve_model(cfg.model, cfg.model_revision, cfg.trust_remote_code)
    out, flat = [], None
    for backend in ("torch", "mlx"):
        rl = RLConfig(rollout_url=[], reward=[], backend=backend, clip_eps=clip_eps,
                      kl_coef=kl_coef)
        island = island_backend(cfg, rl)
        island.load(cfg, source)
        weights = island.attach(cfg)
        if flat is None:
            flat = (np.random.default_rng(0).standard_normal(weights.layout.numel) * 0.05
                    ).astype(np.float32)
        weights.set(flat)
        policy = policy_of(rl, island, source.path)
        policy.flat, policy.layout = weights.get, weights.layout
        out.append(policy)
    return out


@contextmanager
def serving(node):
    """`node` (a `yeto.rollout.server.RolloutNode`) served on loopback in this process:
    yields its base URL; shuts the server and the node down on leaving."""
    from yeto.rollout.server import serve_in_thread

    server, url = serve_in_thread(node)
    try:
        yield url
    finally:
        server.shutdown()
        server.server_close()
        node.close()
