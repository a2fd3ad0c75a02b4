import sys

from gradspec.cli import console

sys.exit(console())
