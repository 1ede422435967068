"""Reinforcement learning islands: `python -m yeto.rl` (GRPO).

- `rewards`: built-in rewards for the demo task and `--reward module:function`;
- `prompts`: RL prompts (token ids, text, reference) from the data formats;
- `pool`: rollout nodes (`python -m yeto.rollout`, or any vLLM-compatible server)
  as a pool: groups round-robined, failed nodes skipped and reused;
- `seqs`: samples, group-normalised advantages, padded batches (backend-free);
- `grpo`: the torch part of a step (logprob recomputation, the clipped loss, AdamW;
  `TorchGRPO`); its MLX twin is `yeto.mlx.grpo.MLXGRPO` (`--backend mlx`);
- `trainer`: the GRPO step and the held-out reward (greedy, own weights), backend-free;
- `overlap`: where a step's samples come from: drawn when it starts, or one step
  ahead (`--async-rollouts`);
- `direct`: rollout nodes the trainer keeps current itself (`--update-nodes`);
- `run`: the island (`yeto.island.Island` syncing, as every island);
- `cli`: `python -m yeto.rl`: its flags, the run's `RLConfig`, `main`;
- `demo`: `yeto demo --rl`.
"""
