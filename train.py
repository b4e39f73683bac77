"""Entry point: `python train.py ...` (same as `python -m slime.train ...`; see --help)."""

import sys

from slime.train import main

if __name__ == "__main__":
    sys.exit(main())
