"""One RL run: the session that owns its handles and steps (session.py), the process around it (launch.py:
Ray, placement, clean-up) and the loops over the session (synchronous.py, one_step_off.py, rollout_only.py).

The loops are strategies: each receives a RunSession and drives its iterations; none imports another, and the
session and launcher import none of them (the entry points, slime/train.py and slime/train_async.py, pick one).
docs/architecture.md draws who owns what.
"""
