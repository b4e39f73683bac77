"""A group of trainer rank actors (one per device), driven as one object from the training loop."""

from __future__ import annotations

from typing import Any

from slime.ray.placement_group import DeviceSlots


def _pid_and_memory(_actor) -> tuple[int, bool]:
    """(the rank's process id, whether its device memory is the host's), asked inside the rank."""
    import os

    from slime.accelerator import get_accelerator

    return os.getpid(), bool(get_accelerator().memory_is_host())


class RayTrainGroup:
    """Creates `len(slots)` trainer actors, rank i on bundle i; methods call every rank and return
    rank 0's result (ranks hold identical metrics after their own all-reduces)."""

    def __init__(self, args, slots: DeviceSlots, actor_cls: Any = None) -> None:
        import ray

        if actor_cls is None:
            from slime.backends.megatron.actor import MegatronTrainRayActor

            actor_cls = MegatronTrainRayActor
        remote_cls = ray.remote(actor_cls) if not hasattr(actor_cls, "remote") else actor_cls
        world = len(slots)
        self.args = args
        self.actors: list[Any] = []
        master = None
        for rank in range(world):
            # --train-env-vars: the user's environment on top of the accelerator's (upstream's order)
            actor = remote_cls.options(**slots.actor_options(rank, extra_env=args.train_env_vars)).remote(
                world, rank, master)
            if rank == 0:
                master = ray.get(actor.get_master_addr_port.remote())
            self.actors.append(actor)
        # process ids, to release what a killed rank leaves behind (its shared-memory files); whether the ranks'
        # memory is the host's: then offload()/onload() free nothing (MegatronTrainRayActor.offload returns at
        # once) and the group skips their Ray round trips, two per iteration with --offload-train
        found = ray.get([a.__ray_call__.remote(_pid_and_memory) for a in self.actors])
        self.pids: list[int] = [pid for pid, _ in found]
        self.memory_is_host = all(host for _, host in found)

    def _all(self, method: str, *args, **kwargs) -> list[Any]:
        from slime.ray.waiting import get  # ray.get that does not wake the driver while the ranks work

        return get([getattr(a, method).remote(*args, **kwargs) for a in self.actors])

    def init(self, role: str = "actor", with_ref: bool = False) -> int:
        """Load models, build optimizers, restore a checkpoint; returns the first rollout id to run."""
        return self._all("init", self.args, role, with_ref)[0]

    def train_rollout(self, rollout_id: int, data_ref, reuse_train_log_probs: bool) -> dict[str, float]:
        """Log-probs, advantages and training of one rollout; `data_ref` is the rollout manager's object
        reference, resolved by Ray on each rank (never on the driver)."""
        return self._all("train_rollout", rollout_id, data_ref, reuse_train_log_probs)[0]

    def connect_rollout_engines(self, engines: list[dict[str, Any]]) -> str:
        return self._all("connect_rollout_engines", engines)[0]

    def update_weights(self, version: int, engines: list[dict[str, Any]] | None = None) -> dict[str, float]:
        return self._all("update_weights", version, engines)[0]

    def advance_old_actor(self) -> None:
        """--keep-old-actor: move the kept weight copies on after a weight sync."""
        self._all("advance_old_actor")

    def save(self, rollout_id: int, extra_state: dict[str, Any]) -> dict[str, float]:
        return self._all("save", rollout_id, extra_state)[0]

    def finish_save(self) -> dict[str, float]:
        """--async-save: publish the last checkpoint, whose files may still be being written."""
        return self._all("finish_save")[0]

    def load_extra_state(self) -> dict[str, Any] | None:
        return self._all("loaded_extra_state")[0]

    def offload(self) -> None:
        if not self.memory_is_host:
            self._all("offload")

    def onload(self) -> None:
        if not self.memory_is_host:
            self._all("onload")

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            try:
                ray.get(a.shutdown.remote(), timeout=30)
            except Exception:
                pass
            ray.kill(a)
