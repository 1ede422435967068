import sys

from yeto.cli import main

sys.exit(main())
