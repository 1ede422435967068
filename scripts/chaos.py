"""The chaos harness (yeto.testing.chaos) from a checkout: a real fleet under a seeded
schedule of faults, then the run's checks; --help lists the fault kinds and checks.

    python scripts/chaos.py --faults 20 --seed 1
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's yeto, syncer

from yeto.testing.chaos import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
