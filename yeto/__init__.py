"""yeto: DiLoCo-style federated fine-tuning across mixed hardware.

The core (layout, codec, client, island) is backend-neutral and works on numpy
arrays; torch lives in `yeto.learner`, MLX in `yeto.mlx`.
"""

__version__ = "0.1.0"
