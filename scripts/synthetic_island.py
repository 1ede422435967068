"""The synthetic island (yeto.testing.synthetic) from a checkout: a numpy island through
the real Island and gRPC client, no model; --help lists its flags.

    python scripts/synthetic_island.py --syncer 127.0.0.1:29400 --learner-id sim-0
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's yeto

from yeto.testing.synthetic import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
