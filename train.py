"""Entry point: `python train.py ...` (same as `python -m slime.train ...`; see --help)."""

from slime.train import main

if __name__ == "__main__":
    from slime.utils.exits import end_entry_point

    end_entry_point(main())
