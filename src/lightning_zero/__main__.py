"""`python -m lightning_zero ...` runs the `lightning-zero` console script."""

import sys

from lightning_zero.cli import main

if __name__ == "__main__":
    sys.exit(main())
