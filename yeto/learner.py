"""`python -m yeto.learner`: the torch island (it lives in `yeto.torch.learner`)."""

import sys

from yeto.signals import die_with_threads
from yeto.torch.learner import main

if __name__ == "__main__":
    die_with_threads()  # a dead push or receive thread must not leave a silent island
    sys.exit(main())
