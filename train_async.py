"""Entry point: `python train_async.py ...`, the one-step-off-policy loop (slime/train_async.py; see --help)."""

import sys

from slime.train_async import main

if __name__ == "__main__":
    sys.exit(main())
