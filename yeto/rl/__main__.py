import sys

from yeto.rl.cli import main

sys.exit(main())
