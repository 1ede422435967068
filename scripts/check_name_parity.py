"""`yeto check-parity` from a checkout: do the torch and MLX islands train the same
tensors of the same model, and compute the same logits with the same adapter?

    python scripts/check_name_parity.py --model runs/demo/model [--lora-targets auto]

The same program and flags as `yeto check-parity` (yeto.cli.parity; --help lists them).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's yeto

from yeto.cli.parity import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
