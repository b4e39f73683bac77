"""Entry point: `python train_async.py ...`, the one-step-off-policy loop (slime/train_async.py; see --help)."""

from slime.train_async import main

if __name__ == "__main__":
    from slime.utils.exits import end_entry_point

    end_entry_point(main())
