import sys

from yeto.rl.cli import main
from yeto.signals import island_process

sys.exit(island_process(main))
