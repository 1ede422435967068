"""`python -m yeto.learner`: the torch island (it lives in `yeto.torch.learner`)."""

import sys

from yeto.signals import island_process
from yeto.torch.learner import main

if __name__ == "__main__":
    sys.exit(island_process(main))
