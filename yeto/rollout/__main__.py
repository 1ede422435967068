import sys

from yeto.rollout.cli import main

sys.exit(main())
