"""`MegatronTrainRayActor`: one trainer rank (one accelerator device) as a Ray actor.

A facade: `init` joins the trainer's process group (slime.backends.megatron.rendezvous), builds the rank's
`PolicyModel` (layout, model, optimizer, held weight copies: slime.backends.megatron.policy), the critic
(--advantage-estimator ppo) and the `StepRunner` that trains them per rollout
(slime.backends.megatron.step_runner); the rest of its methods answer the driver: log-probs, one rollout's
training, weight sync to the engines, checkpoints and offloading.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from slime.accelerator import get_accelerator
from slime.backends.megatron import data as D
from slime.backends.megatron import hooks
from slime.backends.megatron import rendezvous
from slime.backends.megatron.checkpoint import torch_dist as ckpt
from slime.backends.megatron.manual_gc import ManualGC
from slime.backends.megatron.policy import PolicyModel
from slime.backends.megatron.step_runner import StepRunner
from slime.utils.net import node_ip

logger = logging.getLogger(__name__)


def _policy_attribute(name: str, doc: str) -> property:
    """The policy's `name`, read and written through the actor (its public face: tests, plugins, the critic)."""
    return property(lambda self: None if self.policy is None else getattr(self.policy, name),
                    lambda self, value: setattr(self.policy, name, value), doc=doc)


class MegatronTrainRayActor:
    manual_gc = ManualGC(enabled=False)  # init() replaces it from --manual-gc

    model = _policy_attribute("model", "The Megatron model (DDP-wrapped).")
    optimizer = _policy_attribute("optimizer", "Megatron's optimizer of the model.")
    lr_scheduler = _policy_attribute("lr_scheduler", "The LR schedule (a function of the optimizer step).")
    ref_weights = _policy_attribute("ref_weights", "The reference policy's weights, on the host.")
    teacher_weights = _policy_attribute("teacher_weights", "--use-opd --opd-type megatron: the teacher's, on the host.")
    old_actor = _policy_attribute("old_actor", "--keep-old-actor: the old-actor weight copies.")
    device = property(lambda self: self.policy.device)
    dp_size = property(lambda self: self.policy.dp_size)
    dp_rank = property(lambda self: self.policy.dp_rank)
    dp_group = property(lambda self: self.policy.dp_group)
    tp_rank = property(lambda self: self.policy.tp_rank)
    cp_rank = property(lambda self: self.policy.cp_rank)
    pp_size = property(lambda self: self.policy.pp_size)
    last_stage = property(lambda self: self.policy.last_stage)

    def __init__(self, world_size: int, rank: int, master: tuple[str, int] | None = None) -> None:
        self.world_size, self.rank = world_size, rank
        self._store = None
        import torch.distributed as dist

        if master is None and not dist.is_initialized():  # rank 0: host the rendezvous store now (a bound port)
            host = node_ip()
            self._store = rendezvous.host_store(host, world_size)
            master = (host, self._store.port)
        self.master = master
        self.policy: PolicyModel | None = None
        self.runner: StepRunner | None = None
        self.critic = None
        self.weight_sync = None
        self.profiler = None
        self._extra_state: dict[str, Any] | None = None
        self._pending_save = None  # --async-save: the checkpoint whose files are being written (async_save.PendingSave)

    def get_master_addr_port(self) -> tuple[str, int]:
        return self.master

    # --- set-up ---------------------------------------------------------------------------
    def init(self, args, role: str = "actor", with_ref: bool = False) -> int:
        """Join the trainer group, build the policy (and critic), resume from --load; the first rollout id."""
        import warnings

        # megatron-core warns at import about optional fused kernels it falls back from; not actionable here.
        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
        self.args = args
        rendezvous.join_trainer_group(args, self.rank, self.world_size, self._store, self.master)
        self.policy = policy = PolicyModel(args, self.rank, self.world_size)
        ckpt.seed_everything(args.seed)
        found = policy.load(with_ref)
        self.runner = StepRunner(args, policy)  # its loss settings and hooks, read before the critic is built
        if args.use_critic:  # --advantage-estimator ppo: a value model on these ranks
            from slime.backends.megatron.critic import Critic

            self.critic = self.runner.critic = Critic(policy, args)
        policy.load_teacher_and_replay()
        start_rollout_id, self._extra_state = policy.resume(found)
        policy.start_schedule(start_rollout_id)
        from slime.backends.megatron.profiler import TrainProfiler

        self.profiler = policy.profiler = TrainProfiler(args, self.rank)  # --use-pytorch-profiler, --record-memory-history
        self.manual_gc = self.runner.manual_gc = ManualGC.from_args(args)  # --manual-gc
        self.profiler.on_init_end()
        hooks.on_init(args)  # --custom-megatron-init-path
        return start_rollout_id

    def loaded_extra_state(self) -> dict[str, Any] | None:
        return self._extra_state

    # the policy's passes under the names the tests and workers use
    def _layout(self) -> dict[str, int]:
        return self.policy.layout()

    def _log_probs_of(self, batch: D.RolloutBatch, indices: list[int],
                      entropy: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
        return self.policy.log_probs_of(batch, indices, entropy)

    def _my_samples(self, batch: D.RolloutBatch) -> list[int]:
        return self.policy.my_samples(batch)

    def _dp_shard(self, batch: D.RolloutBatch, step: list[int]) -> list[int]:
        return self.policy.dp_shard(batch, step)

    def _pack(self, batch: D.RolloutBatch, indices: list[int]) -> D.PackedMicroBatch:
        return self.policy.pack(batch, indices)

    def _micro_batches(self, batch: D.RolloutBatch, indices: list[int],
                       max_tokens: int | None = None) -> list[list[int]]:
        return self.policy.micro_batches(batch, indices, max_tokens)

    def _from_last_stage(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        return self.policy.from_last_stage(*tensors)

    def _maybe_update_reference(self, rollout_id: int) -> bool:
        return self.policy.maybe_update_reference(rollout_id)

    # --- per rollout ----------------------------------------------------------------------
    def compute_log_probs(self, batch: D.RolloutBatch) -> dict[str, Any]:
        """Old-policy (current weights) and reference log-probs of this rank's samples, no grad. With
        batch.reuse_train_log_probs only the reference's: train() takes the old ones from its own forward."""
        return self.policy.compute_log_probs(batch)

    def train_rollout(self, rollout_id: int, payload: dict[str, Any], reuse_train_log_probs: bool) -> dict[str, float]:
        """Log-probs, advantages and training for one rollout, from the rollout manager's payload
        (slime.rollout.train_payload.pack_samples; Ray hands every rank the object-store arrays, the driver never holds
        them). Each rank works on its own data-parallel share; metrics are reduced over the group."""
        from slime.backends.megatron.rollout_data import batch_from_payload

        started = time.perf_counter()
        batch = batch_from_payload(payload)
        # the driver knows the sample count only: with forked rollouts the steps are counted here
        batch.reuse_train_log_probs = reuse_train_log_probs and len(D.batch_steps(batch, self.args.global_batch_size)) == 1
        metrics: dict[str, float] = {"time/log_probs": 0.0, "time/log_probs_old": 0.0, "time/log_probs_ref": 0.0,
                                     "train/reused_log_probs": float(batch.reuse_train_log_probs),
                                     **self.finish_save(blocking=False)}  # --async-save: written during the rollout
        return self.runner.train_rollout(rollout_id, batch, metrics, started)

    def train(self, rollout_id: int, batch: D.RolloutBatch) -> dict[str, float]:
        """The optimizer steps of one rollout's batch (its log-probs and advantages already in it)."""
        return self.runner.train(rollout_id, batch)

    # --- weight sync ----------------------------------------------------------------------
    def connect_rollout_engines(self, engines: list[dict[str, Any]]) -> str:
        from slime.backends.megatron.weight_sync import create_weight_sync

        self.weight_sync = create_weight_sync(self.args, self.model, engines, self.rank)
        self.weight_sync.connect()
        return self.weight_sync.mode

    def update_weights(self, version: int, engines: list[dict[str, Any]] | None = None) -> dict[str, float]:
        """Sync weights to the engines; `engines` is the rollout manager's current list (restarted engines
        may have new ports or need to rejoin the distributed group)."""
        from slime.backends.megatron.weight_sync import EngineEndpoint

        if self.weight_sync is None:
            raise RuntimeError("update_weights called before connect_rollout_engines")
        endpoints = None if engines is None else [EngineEndpoint.from_dict(e) for e in engines]
        return self.weight_sync.sync(version, endpoints)

    def advance_old_actor(self) -> None:
        """--keep-old-actor: the weights were synced to the engines (slime.backends.megatron.old_actor)."""
        if self.old_actor is not None:
            self.old_actor.after_sync(self.model)

    # --- checkpoints ----------------------------------------------------------------------
    def save(self, rollout_id: int, extra_state: dict[str, Any]) -> dict[str, float]:
        t0 = time.perf_counter()
        finished = self.finish_save()  # --async-save: the previous one is published before the next starts
        t_save = time.perf_counter()
        saved = ckpt.save(self.args.save, rollout_id, self.model, self.optimizer, self.rank, self._layout(),
                          extra_state, vocab_divisible_by=self.args.make_vocab_size_divisible_by,  # Megatron's padding
                          async_save=self.args.async_save)
        if self.args.async_save:  # a PendingSave: its files are being written
            self._pending_save = saved
            finished["time/save_staging"] = time.perf_counter() - t_save
        if self.critic is not None:  # its own torch_dist checkpoint (slime.backends.megatron.critic)
            self.critic.save(self.args, rollout_id)
        if self.args.save_hf:
            from slime.backends.megatron import model_setup

            model_setup.save_hf(self.model, self.args.save_hf.replace("{rollout_id}", str(rollout_id)), self.args)
        return {**finished, "time/save": time.perf_counter() - t0}

    def finish_save(self, blocking: bool = True) -> dict[str, float]:
        """--async-save: publish the checkpoint whose files are being written (collective: every rank calls it at
        the same point). blocking=False publishes it only when every rank's writes are done, else leaves it."""
        from slime.backends.megatron.checkpoint.async_save import written_everywhere

        pending = self._pending_save
        if pending is None or (not blocking and not written_everywhere(pending)):
            return {}
        t0 = time.perf_counter()
        self._pending_save = None
        final, waited = pending.finish()
        if self.rank == 0:
            logger.info("--async-save: %s published (%.3f s waited for its writes)", final, waited)
        return {"time/async_save_wait": waited, "time/async_save_finish": time.perf_counter() - t0}

    # --- memory (--offload-train) ---------------------------------------------------------
    def offload(self) -> int:
        """Release device memory of weights, grads and optimizer state (no-op on the CPU device)."""
        from slime.backends.megatron.offload import Offloader

        acc = get_accelerator()
        if acc.memory_is_host():
            return 0
        if getattr(self, "_offloader", None) is None:
            self._offloader = Offloader(self.model, self.optimizer)
        released = self._offloader.offload()
        if self.critic is not None:  # --advantage-estimator ppo: the critic's model and optimizer too
            if getattr(self, "_critic_offloader", None) is None:
                self._critic_offloader = Offloader(self.critic.model, self.critic.optimizer)
            released += self._critic_offloader.offload()
        acc.synchronize()
        acc.empty_cache()
        return released

    def onload(self) -> None:
        if getattr(self, "_offloader", None) is not None:
            self._offloader.onload()
            if getattr(self, "_critic_offloader", None) is not None:
                self._critic_offloader.onload()
            get_accelerator().synchronize()

    def shutdown(self) -> None:
        if self.profiler is not None:  # (set by init)
            self.profiler.close()
        if self.weight_sync is not None:
            self.weight_sync.close()
