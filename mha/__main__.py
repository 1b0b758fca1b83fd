"""`python -m mha` runs the command-line interface."""

import sys

from mha.cli import main

sys.exit(main())
