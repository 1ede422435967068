"""What the rl tests in more than one tier share."""


from yeto.config import IslandConfig
from yeto.rl.trainer import RLConfig


def _configs(model_dir, task, urls, **rl):
    train, held_out = task
    cfg = IslandConfig(model=str(model_dir), data=str(train), eval_data=str(held_out),
                       inner_lr=1e-3, threads=1, device="cpu", seed=0).check()
    return cfg, RLConfig(rollout_url=urls, reward=["reversal_accuracy"], group_size=4,
                         prompts_per_step=4, max_new_tokens=12, eval_prompts=8, **rl)
