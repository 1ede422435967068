"""The architecture sweep (yeto.testing.arch_sweep) from a checkout: every decoder-only
causal LM both transformers and mlx-lm implement, checked for torch/MLX island parity;
--help lists its flags.

    python scripts/arch_sweep.py --jobs 2 --markdown sweep.md
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's yeto

from yeto.testing.arch_sweep import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
