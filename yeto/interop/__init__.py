"""What a run's weights and yeto's sync meet outside yeto: adapter files, other
training scripts, and the check that torch and MLX compute the same model.

- `adapters`: LoRA adapters on disk, peft's layout and mlx-lm's, and exact conversion;
- `export`: `yeto export` and `yeto convert`, a run's adapter for peft or mlx-lm;
- `integrations`: DiLoCo for training scripts you already have (`DiLoCo`,
  `DiLoCoCallback`, `MLXDiLoCo`);
- `parity`: do the torch island and the MLX island compute the same model (names,
  shapes, order, then logits)?
"""
