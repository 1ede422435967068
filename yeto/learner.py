"""`python -m yeto.learner`: the torch island (it lives in `yeto.torch.learner`)."""

import sys

from yeto.torch.learner import main

if __name__ == "__main__":
    sys.exit(main())
