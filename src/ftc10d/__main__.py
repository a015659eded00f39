"""``python -m ftc10d``: the same command line as the ``ftc10d`` script."""

import sys

from ftc10d.cli import main

if __name__ == "__main__":  # guard: spawn/forkserver children re-import the main module
    sys.exit(main())
