import sys

from yeto.rl.cli import main
from yeto.signals import die_with_threads

die_with_threads()  # a dead push, receive or sampling thread must not leave a silent island
sys.exit(main())
