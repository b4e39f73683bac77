"""Entry point train.py uses for the rollout side (see slime.ray.rollout_manager)."""

from slime.ray.rollout_manager import RolloutManager, create_rollout_manager, resolve_engine_kind

__all__ = ["RolloutManager", "create_rollout_manager", "resolve_engine_kind"]
