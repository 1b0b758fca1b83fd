"""Run the benchmarks from a checkout: `python benchmarks/run.py [--quick] [--json] ...`.

The runner lives in the package (`mha/bench.py`) so that the installed `mha bench` command
runs the same code; this file only makes the checkout's copy importable and calls it.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from mha.bench import main

if __name__ == "__main__":
    sys.exit(main())
