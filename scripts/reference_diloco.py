"""DiLoCo's Algorithm 1 in plain torch (yeto.testing.reference_diloco) from a checkout:
the independent reference yeto's outer loop is checked against; --help lists its flags.

    python scripts/reference_diloco.py --model runs/demo/model \
        --data runs/demo/data/train.jsonl --islands 2 --rounds 3 --yeto --out runs/reference
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's yeto, syncer

from yeto.testing.reference_diloco import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
