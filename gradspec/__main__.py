import sys

from gradspec.cli import main

sys.exit(main())
