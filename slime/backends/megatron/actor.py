"""`MegatronTrainRayActor`: one trainer rank (one accelerator device) as a Ray actor.

Per rank: select the device, join the trainer's process group on the accelerator's collective
backend, apply the accelerator's Megatron patches, load the HF checkpoint into the Megatron model,
build the Megatron optimizer; then per rollout: log-probs (old policy, reference) without grad,
train steps over packed micro-batches with gradient clipping, weight sync to the engines, save.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from slime.accelerator import get_accelerator
from slime.backends.megatron.checkpoint import torch_dist as ckpt
from slime.backends.megatron import ci_checks
from slime.backends.megatron import data as D
from slime.backends.megatron import hooks
from slime.backends.megatron.loss import METRIC_KEYS, MISMATCH_KEYS, LossConfig, LossHooks, rl_loss, sft_loss
from slime.backends.megatron.manual_gc import ManualGC
from slime.backends.megatron.timing import PhaseTimer
from slime.utils.net import node_ip

logger = logging.getLogger(__name__)


def _host_store(host: str, world_size: int):
    """Rank 0's rendezvous store (it listens on every interface, on a port the OS picks; `host` is the address
    the ranks reach, rank 0's own client included), created with the actor. A port only
    chosen then and bound at init() could meanwhile be taken by any of the run's processes starting up (the
    other ranks, the engines, Ray's workers): rank 0 then failed to bind it while the other ranks waited for
    its store until their rendezvous timeout (30 min)."""
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout  # init_process_group's rendezvous timeout

    return dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False, multi_tenant=True,
                         timeout=default_pg_timeout)


def _client_store(master: tuple[str, int], world_size: int):
    """Rank > 0: a client of rank 0's store. Every rank passes an explicit store to init_process_group: a tcp://
    init_method keeps its keys where a store passed in by rank 0 does not, and the ranks would never meet."""
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    return dist.TCPStore(*master, world_size, is_master=False, timeout=default_pg_timeout)


class MegatronTrainRayActor:
    manual_gc = ManualGC(enabled=False)  # init() replaces it from --manual-gc

    def __init__(self, world_size: int, rank: int, master: tuple[str, int] | None = None) -> None:
        self.world_size, self.rank = world_size, rank
        self._store = None
        import torch.distributed as dist

        if master is None and not dist.is_initialized():  # rank 0: host the rendezvous store now (a bound port)
            host = node_ip()
            self._store = _host_store(host, world_size)
            master = (host, self._store.port)
        self.master = master
        self.model = None
        self.optimizer = None
        self.ref_weights: dict[str, torch.Tensor] | None = None
        self.weight_sync = None
        self._extra_state: dict[str, Any] | None = None
        self._pending_save = None  # --async-save: the checkpoint whose files are being written (async_save.PendingSave)

    def get_master_addr_port(self) -> tuple[str, int]:
        return self.master

    # --- set-up ---------------------------------------------------------------------------
    def init(self, args, role: str = "actor", with_ref: bool = False) -> int:
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        import warnings

        # megatron-core warns at import about optional fused kernels it falls back from; not actionable here.
        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
        self.args = args
        acc = get_accelerator()
        acc.init_worker_process()
        acc.set_device(0)  # worker_env made exactly this rank's device visible
        self.device = acc.device()
        if args.deterministic_mode:  # before the process group and the model: env of the collectives, algorithms
            acc.set_deterministic()
        if not dist.is_initialized():
            store = self._store if self._store is not None else _client_store(self.master, self.world_size)
            dist.init_process_group(backend=acc.process_group_backend(), store=store, world_size=self.world_size,
                                    rank=self.rank)
        from slime.backends.megatron import init_parallel

        init_parallel(args.tensor_model_parallel_size, args.expert_model_parallel_size,
                      args.pipeline_model_parallel_size, seed=args.seed, etp=args.expert_tensor_parallel_size,
                      cp=args.context_parallel_size)  # patches + model-parallel groups
        self.tp_size = mpu.get_tensor_model_parallel_world_size()
        self.tp_rank = mpu.get_tensor_model_parallel_rank()
        self.dp_size = mpu.get_data_parallel_world_size()
        self.dp_rank = mpu.get_data_parallel_rank()
        self.dp_group = mpu.get_data_parallel_group()
        # Context parallel: the CP ranks of one DP rank share its samples, each holding chunks of every sequence.
        self.cp_size = mpu.get_context_parallel_world_size()
        self.cp_rank = mpu.get_context_parallel_rank()
        self.cp_group = mpu.get_context_parallel_group()
        self.pp_size = mpu.get_pipeline_model_parallel_world_size()
        self.pp_group = mpu.get_pipeline_model_parallel_group()
        self.pp_last_rank = mpu.get_pipeline_model_parallel_last_rank()
        self.last_stage = mpu.is_pipeline_last_stage()
        ckpt.seed_everything(args.seed)

        from slime.backends.megatron import model_setup

        if with_ref:
            # The reference policy is held on the host and swapped in for its log-probs (no second model on device).
            ref_model = model_setup.load_reference(args)
            self.ref_weights = model_setup.host_copy(ref_model)
            del ref_model
        found = ckpt.find_checkpoint(args.load) if args.load else None
        # An HF directory as --load gives the initial weights; a trainer checkpoint is restored on top.
        self.model = model_setup.load_model(args, found.path if found and found.kind == ckpt.HF else args.hf_checkpoint)
        from slime.backends.megatron.freeze import freeze_parameters

        freeze_parameters(self.model, args.only_train_params_name_list, args.freeze_params_name_list)
        self.model, self.optimizer = model_setup.wrap_and_build_optimizer(args, self.model)
        self.loss_config = LossConfig.from_args(args)
        self.loss_hooks = LossHooks.from_args(args)  # --custom-tis-function-path, --custom-pg-loss-reducer-...
        self.critic = None
        if args.use_critic:  # --advantage-estimator ppo: a value model on these ranks
            from slime.backends.megatron.critic import Critic

            self.critic = Critic(self, args)
        self.teacher_weights = None
        if args.use_opd and args.opd_type == "megatron":  # held on the host like the reference
            teacher = model_setup.load_reference(args, args.opd_teacher_load, "--opd-teacher-load")
            self.teacher_weights = model_setup.host_copy(teacher)
            del teacher
        if args.use_routing_replay:
            self._install_routing_replay()

        start_rollout_id = 0
        if found is None or found.kind in (ckpt.HF, ckpt.NONE):
            if found is not None:
                logger.info("--load %s: %s", args.load, "HF weights, starting at rollout 0" if found.kind == ckpt.HF
                            else "no checkpoint yet, starting from --hf-checkpoint")
        else:
            resumed = ckpt.load(args.load, self.model, self.optimizer, self.rank, self._layout(),
                                ckpt.LoadOptions.from_args(args))
            self._extra_state = resumed.extra_state
            logger.info("loaded %s (%s); starting at rollout %d", found.path, ", ".join(resumed.restored),
                        resumed.start_rollout_id)
            start_rollout_id = resumed.start_rollout_id
        # the LR schedule is a pure function of the step: a resumed run starts it at its step
        self.lr_scheduler = model_setup.build_lr_scheduler(args, self.optimizer, start_rollout_id)
        self.old_actor = None
        if args.keep_old_actor:  # the loaded weights: actor, old_actor and rollout_actor start equal
            from slime.backends.megatron.old_actor import OldActor

            self.old_actor = OldActor(self.model, args.update_weights_interval)
        from slime.backends.megatron.profiler import TrainProfiler

        self.profiler = TrainProfiler(args, self.rank)  # --use-pytorch-profiler, --record-memory-history
        self.manual_gc = ManualGC.from_args(args)  # --manual-gc
        self.profiler.on_init_end()
        hooks.on_init(args)  # --custom-megatron-init-path
        return start_rollout_id

    def _layout(self) -> dict[str, int]:
        a = self.args
        layout = {"world_size": self.world_size, "tp": a.tensor_model_parallel_size,
                  "ep": a.expert_model_parallel_size, "pp": a.pipeline_model_parallel_size}
        if a.context_parallel_size > 1:  # (absent at CP 1: checkpoints from before CP keep their layout)
            layout["cp"] = a.context_parallel_size
        return layout

    def _install_routing_replay(self) -> None:
        from megatron.core import parallel_state as mpu

        from slime.utils import routing_replay
        from slime_plugins.models.common.model import install_routing_replay

        if install_routing_replay(self.model) == 0 and mpu.get_pipeline_model_parallel_world_size() == 1:
            raise ValueError("--use-routing-replay / --use-rollout-routing-replay: the model has no MoE layer to "
                             "replay routes in; drop the flag")
        from slime.backends.megatron.hf_export import unwrap

        # the model runs sequence parallel whenever TP > 1: MoE layers then see their TP rank's slice of the tokens
        sp = bool(unwrap(self.model).config.sequence_parallel) and self.tp_size > 1
        routing_replay.REPLAY.layout = {"tp_rank": self.tp_rank, "sp_size": self.tp_size if sp else 1}

    def _old_pass_replay(self, batch: D.RolloutBatch):
        """The old-policy log-prob pass: the engine's routes (--use-rollout-routing-replay), or the routers'
        own, recorded for the training pass (--use-routing-replay)."""
        from contextlib import nullcontext

        from slime.utils.routing_replay import REPLAY

        if self.args.use_rollout_routing_replay:
            return REPLAY.replaying("rollout", batch)
        return REPLAY.recording() if self.args.use_routing_replay else nullcontext()

    def _train_pass_replay(self, batch: D.RolloutBatch):
        """The training pass routes as the old-policy pass did (recorded; none recorded when the training
        forward's own log-probs are the old ones: its routers then are the old policy's)."""
        from contextlib import nullcontext

        from slime.utils.routing_replay import REPLAY

        if self.args.use_rollout_routing_replay:
            return REPLAY.replaying("rollout", batch)
        if self.args.use_routing_replay and REPLAY.recorded:
            return REPLAY.replaying("recorded")
        return nullcontext()

    def loaded_extra_state(self) -> dict[str, Any] | None:
        return self._extra_state

    # --- forward --------------------------------------------------------------------------
    def _sampling_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[T, V] logits of the sampling distribution: divided by the rollout temperature, so the actor's, old
        and reference log-probs are those the engines report for their samples (SGLang's default)."""
        logits = logits.reshape(-1, logits.shape[-1])
        temperature = self._temperature()
        if temperature == 1.0:
            return logits
        # No grad: in place, no second [T, V] copy. With grad the logits are a view made by a custom
        # autograd function, which autograd forbids modifying in place; the original is freed once replaced.
        return logits / temperature if torch.is_grad_enabled() else logits.div_(temperature)

    def _run_schedule(self, micro_batches: list[D.PackedMicroBatch], on_logits, forward_only: bool,
                      timer: PhaseTimer | None = None, mtp_logits: bool = False) -> None:
        """Megatron's schedule over the packed micro-batches; `on_logits(mb, logits)` runs on the last stage
        (with mtp_logits: `logits` is (logits, [MTP depth logits])). `timer` (when given) gets a "forward"
        span per forward computation (model and loss), from events."""
        from slime.backends.megatron import model_setup
        from slime.backends.megatron.pipeline import forward_backward

        def timed(fn):
            if timer is None:
                return fn

            def run(*a):
                start = timer.mark()
                out = fn(*a)
                timer.lap("forward", start)
                return out
            return run

        from slime.utils.routing_replay import REPLAY

        def forward(m, mb):
            REPLAY.begin_micro_batch(mb)  # routing replay: the routes of this micro-batch (no-op when off)
            return model_setup.forward(m, mb, self.device, mtp_logits=mtp_logits)

        forward_backward(self.model, micro_batches, timed(forward),
                         timed(on_logits), forward_only)

    def _from_last_stage(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """The last pipeline stage's values of `tensors` on every stage (one broadcast over the pipeline group)."""
        if self.pp_size == 1:
            return list(tensors)
        import torch.distributed as dist

        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).to(self.device)
        dist.broadcast(flat, src=self.pp_last_rank, group=self.pp_group)
        out, at = [], 0
        for t in tensors:
            out.append(flat[at:at + t.numel()].cpu().reshape(t.shape).to(t.dtype))
            at += t.numel()
        return out

    def _temperature(self) -> float:
        # Greedy rollouts (temperature 0) report log_softmax of the raw logits.
        t = float(self.args.rollout_temperature or 0.0)
        return t if t > 0 else 1.0

    def _dp_shard(self, batch: D.RolloutBatch, step: list[int]) -> list[int]:
        if self.args.balance_data:
            return D.balanced_dp_shard(step, [len(batch.tokens[i]) for i in step], self.dp_rank, self.dp_size)
        return D.dp_shard(step, self.dp_rank, self.dp_size)

    def _pad_multiple(self) -> int:
        # Sequence parallel splits the packed row over TP ranks; --data-pad-size-multiplier pads further;
        # context parallel cuts every sequence into 2*CP chunks and each rank's share must still split over TP.
        cp = 2 * self.cp_size if self.cp_size > 1 else 1
        return self.tp_size * self.args.data_pad_size_multiplier * cp

    def _pack(self, batch: D.RolloutBatch, indices: list[int]) -> D.PackedMicroBatch:
        """One packed micro-batch; under context parallel with this CP rank's share attached."""
        mb = D.pack(batch, indices, self._pad_multiple(), cp_size=self.cp_size)
        if self.cp_size > 1:
            D.split_for_context_parallel(mb, self.cp_size, self.cp_rank, self.cp_group)
        return mb

    def _my_samples(self, batch: D.RolloutBatch) -> list[int]:
        """Samples this rank trains on this rollout (its data-parallel shard of every step)."""
        mine: list[int] = []
        for step in D.step_indices(len(batch), self.args.global_batch_size):
            mine.extend(self._dp_shard(batch, step))
        return mine

    def _micro_batches(self, batch: D.RolloutBatch, indices: list[int],
                       max_tokens: int | None = None) -> list[list[int]]:
        """Micro-batches (lists of sample indices into `batch`); the count is equal on every rank.
        `max_tokens`: the token budget per device (default --max-tokens-per-gpu)."""
        import torch.distributed as dist

        if not self.args.use_dynamic_batch_size:
            return [[indices[i] for i in mb] for mb in D.fixed_micro_batches(len(indices), self.args.micro_batch_size)]
        lengths = [len(batch.tokens[i]) for i in indices]
        # per device: a CP rank holds 1/CP of each pack
        budget = (max_tokens or self.args.max_tokens_per_gpu) * self.cp_size
        if self.args.balance_by_flops:
            return self._flops_balanced(indices, lengths, budget)
        count = torch.tensor([len(D.first_fit_decreasing(lengths, budget))])
        dist.all_reduce(count, op=dist.ReduceOp.MAX)  # MoE all-to-all and grad sync need lock-step ranks
        bins = D.dynamic_micro_batches(lengths, budget, int(count.item()))
        return [[indices[i] for i in b] for b in bins]

    def _flops_balanced(self, indices: list[int], lengths: list[int], budget: int) -> list[list[int]]:
        """--balance-by-flops: the token budget's micro-batch count (the largest over data-parallel ranks),
        the samples split by forward FLOPs (slime.backends.megatron.flops_balance)."""
        import torch.distributed as dist

        from slime.backends.megatron import flops_balance as F

        count = torch.tensor([F.micro_batch_count(lengths, budget)])
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        coeff = F.flops_coefficient(self.model.module.arch if hasattr(self.model, "module") else self.model.arch)
        bins = F.flops_balanced_micro_batches(lengths, budget, coeff, int(count.item()))
        return [[indices[i] for i in b] for b in bins]

    @torch.no_grad()
    def _log_probs_of(self, batch: D.RolloutBatch, indices: list[int],
                      entropy: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
        """Per-sample response log-probs of `indices`, on every pipeline stage (the last computes them);
        `entropy` (when given) gets each sample's per-token entropy on the last stage."""
        out: dict[int, torch.Tensor] = {}
        ops = get_accelerator().ops
        zero = torch.zeros((), device=self.device)

        def on_logits(mb: D.PackedMicroBatch, logits: torch.Tensor) -> torch.Tensor:
            lp, ent = D.response_log_probs(self._sampling_logits(logits), mb, ops, self.args.log_probs_chunk_size)
            for i, part in zip(mb.sample_indices, D.split_per_sample(lp.float().cpu(), mb.response_lengths)):
                out[i] = part
            if entropy is not None:
                for i, part in zip(mb.sample_indices, D.split_per_sample(ent.float().cpu(), mb.response_lengths)):
                    entropy[i] = part
            return zero.clone()

        from slime.utils.routing_replay import REPLAY

        if REPLAY.mode == "record":  # the training pass's micro-batches, so that it finds their recorded routes
            picked = set(indices)
            groups = [mb for step in D.step_indices(len(batch), self.args.global_batch_size)
                      for mb in self._micro_batches(batch, [i for i in self._dp_shard(batch, step) if i in picked])]
        else:  # no grad: --log-probs-max-tokens-per-gpu may pack more per micro-batch
            groups = self._micro_batches(batch, indices, self.args.log_probs_max_tokens_per_gpu)
        mbs = [self._pack(batch, mb_indices) for mb_indices in groups]
        with self.profiler.log_probs_pass():
            self._run_schedule(mbs, on_logits, forward_only=True)
        if self.pp_size == 1 or not indices:
            return out
        # The other stages need them too (advantages with a KL term, the train-rollout mismatch metric).
        lengths = [batch.response_lengths[i] for i in indices]
        flat = torch.cat([out[i] for i in indices]) if self.last_stage else torch.empty(sum(lengths))
        (flat,) = self._from_last_stage(flat)
        return dict(zip(indices, D.split_per_sample(flat.float(), lengths)))

    def compute_log_probs(self, batch: D.RolloutBatch) -> dict[str, Any]:
        """Old-policy (current weights) and reference log-probs of this rank's samples, no grad. With
        batch.reuse_train_log_probs only the reference's: train() takes the old ones from its own forward."""
        from slime.backends.megatron import model_setup

        t0 = time.perf_counter()
        self.model.eval()
        indices = self._my_samples(batch)
        result = {}
        if not batch.reuse_train_log_probs:
            result["old_log_probs"] = self._log_probs_of(batch, indices)
        t_old = time.perf_counter() - t0
        if self.ref_weights is not None:
            with model_setup.swapped_weights(self.model, self.ref_weights):
                result["ref_log_probs"] = self._log_probs_of(batch, indices)
        keep = self.tp_rank == 0 and self.cp_rank == 0 and self.last_stage  # TP/CP ranks hold identical results
        total = time.perf_counter() - t0
        return {"log_probs": result if keep else {},
                "metrics": {"time/log_probs": total, "time/log_probs_old": t_old, "time/log_probs_ref": total - t_old}}

    # --- one rollout, end to end on the trainer ----------------------------------------------
    def train_rollout(self, rollout_id: int, payload: dict[str, Any], reuse_train_log_probs: bool) -> dict[str, float]:
        """Log-probs, advantages and training for one rollout, from the rollout manager's payload
        (rollout_data.pack_samples; Ray hands every rank the object-store arrays, the driver never holds
        them). Each rank works on its own data-parallel share; metrics are reduced over the group."""
        from slime.backends.megatron import model_setup
        from slime.backends.megatron.rollout_data import GroupReduce, batch_from_payload, share_advantages

        t_call = time.perf_counter()
        args = self.args
        batch = batch_from_payload(payload)
        batch.reuse_train_log_probs = reuse_train_log_probs
        mine = self._my_samples(batch)
        metrics: dict[str, float] = {"time/log_probs": 0.0, "time/log_probs_old": 0.0, "time/log_probs_ref": 0.0,
                                     **self.finish_save(blocking=False)}  # --async-save: written during the rollout
        if self.critic is not None:  # first, as upstream's critic group: its old values feed the actor's GAE
            metrics.update(self.critic.train_rollout(rollout_id, batch, mine))
            if rollout_id < args.num_critic_only_steps:  # --num-critic-only-steps: the actor does not train yet
                metrics["train/actor_trained"] = 0.0
                return metrics
        t0 = time.perf_counter()
        self.model.eval()

        def full(by_index: dict[int, torch.Tensor]) -> list:
            return [by_index.get(i) for i in range(len(batch))]

        sft = args.loss_type == "sft_loss"  # the loss needs neither old log-probs nor advantages
        from contextlib import ExitStack

        old_pass_routes = ExitStack()  # routing replay of the old-policy pass only (not the reference's)
        entropy = None
        if not reuse_train_log_probs and not sft:
            hooks.before_log_prob(args, self.model, "")  # --custom-megatron-before-log-prob-hook-path
            old_pass_routes.enter_context(self._old_pass_replay(batch))
            import contextlib

            with (model_setup.swapped_weights(self.model, self.old_actor.weights) if self.old_actor is not None
                  else contextlib.nullcontext()):  # --keep-old-actor
                entropy = {} if args.use_rollout_entropy else None  # upstream's: for hooks that mask by entropy
                batch.old_log_probs = full(self._log_probs_of(batch, mine, entropy))
        old_pass_routes.close()
        if entropy is not None:
            batch.entropy = full(entropy)
            metrics["rollout/entropy"] = self._token_mean(batch.entropy, batch, mine)
        metrics["time/log_probs_old"] = time.perf_counter() - t0
        if self.ref_weights is not None:
            hooks.before_log_prob(args, self.model, "ref_")
            with model_setup.swapped_weights(self.model, self.ref_weights):
                batch.ref_log_probs = full(self._log_probs_of(batch, mine))
        if self.teacher_weights is not None:  # --use-opd --opd-type megatron
            with model_setup.swapped_weights(self.model, self.teacher_weights):
                batch.teacher_log_probs = full(self._log_probs_of(batch, mine))
        metrics["time/log_probs"] = time.perf_counter() - t0
        metrics["time/log_probs_ref"] = metrics["time/log_probs"] - metrics["time/log_probs_old"]
        if not reuse_train_log_probs and not sft:
            ci_checks.check_log_probs(args, rollout_id, batch.old_log_probs, batch.ref_log_probs, batch.loss_masks)
        t = time.perf_counter()
        if args.compute_advantages_and_returns and not sft:
            metrics.update(share_advantages(args, batch, mine, GroupReduce(self.dp_group)))
        if args.use_rollout_logprobs and batch.rollout_log_probs is not None:
            batch.old_log_probs = [torch.tensor(r, dtype=torch.float32) for r in batch.rollout_log_probs]
        metrics["time/advantages"] = time.perf_counter() - t
        if args.rollout_data_postprocess_path:  # upstream's hook, between advantages and training
            from slime.backends.megatron.rollout_postprocess import postprocess_rollout_data
            from slime.utils.misc import load_function

            postprocess_rollout_data(load_function(args.rollout_data_postprocess_path), args, rollout_id, batch, mine)
        from slime.utils.routing_replay import REPLAY

        try:
            with self._train_pass_replay(batch):
                metrics.update(self.train(rollout_id, batch))
        finally:
            REPLAY.recorded = {}  # this rollout's routes
        self._maybe_update_reference(rollout_id)
        ci_checks.check_mismatch(args, metrics)  # --ci-test
        from slime.backends.megatron import train_dump

        train_dump.dump(args, batch, mine, rollout_id, rank=self.rank, dp_rank=self.dp_rank, dp_size=self.dp_size,
                        dp_group=self.dp_group, writes=self.last_stage and self.tp_rank == 0 and self.cp_rank == 0)
        # the whole call on this rank: the driver's time/train_call less this is Ray's share (and the data's fetch)
        metrics["time/train_rollout"] = time.perf_counter() - t_call
        return metrics

    def _token_mean(self, values: list, batch: D.RolloutBatch, mine: list[int]) -> float:
        """Loss-masked token mean of per-sample `values` (the last stage's) over the data-parallel group,
        known on every stage."""
        import torch.distributed as dist

        acc = torch.zeros(2, dtype=torch.float64)
        for i in mine:
            if values[i] is not None:
                mask = torch.as_tensor(batch.loss_masks[i], dtype=torch.float64)
                acc += torch.stack([(values[i].double() * mask).sum(), mask.sum()])
        dist.all_reduce(acc, group=self.dp_group)
        (acc,) = self._from_last_stage(acc)
        return float(acc[0] / acc[1].clamp_min(1))

    def _maybe_update_reference(self, rollout_id: int) -> bool:
        """--ref-update-interval N (upstream's): after every N-th rollout the reference policy becomes a copy of
        the actor's weights (host memory, as the reference is held)."""
        from slime.backends.megatron import model_setup

        interval = self.args.ref_update_interval
        if not interval or self.ref_weights is None or (rollout_id + 1) % interval:
            return False
        self.ref_weights = model_setup.host_copy(self.model)
        return True

    # --- training -------------------------------------------------------------------------
    def train(self, rollout_id: int, batch: D.RolloutBatch) -> dict[str, float]:
        import torch.distributed as dist

        acc = get_accelerator()
        acc.reset_peak_memory_stats()
        t0 = time.perf_counter()
        self.manual_gc.train_start()
        self.model.train()
        if self.args.reset_optimizer_states:  # Adam starts over each rollout
            from slime.backends.megatron.optimizer import reset_optimizer_states

            reset_optimizer_states(self.optimizer)
        args, ops = self.args, acc.ops
        mtp = bool(args.enable_mtp_training)
        keys = METRIC_KEYS + (("mtp_loss",) if mtp else ()) + (("opsm_clipfrac",) if args.use_opsm else ()) + (
            MISMATCH_KEYS if args.get_mismatch_metrics else ())
        totals = {k: 0.0 for k in keys}
        captured_old: dict[int, torch.Tensor] = {}  # --save-debug-train-data with the training forward's old log-probs
        counts = torch.zeros(3, dtype=torch.float64)  # samples, loss tokens, real tokens (this DP rank)
        grad_norms, losses = [], []
        steps = D.step_indices(len(batch), args.global_batch_size)
        self.profiler.end_log_probs()
        reuse = batch.reuse_train_log_probs
        if reuse and len(steps) != 1:
            raise ValueError(f"reuse_train_log_probs needs one optimizer step per rollout, but {len(batch)} samples make "
                             f"{len(steps)} steps of --global-batch-size {args.global_batch_size}")
        # train-rollout log-prob mismatch when the old log-probs come from here: |diff| sum, token count; max
        mismatch, mismatch_max = torch.zeros(2, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
        # Phase times from device events, read once after the last step: no synchronize() per phase or micro-batch.
        timer = PhaseTimer(acc, ("pack", "forward", "backward", "optimizer"))

        for step_id, step in self.profiler.steps("train_actor", enumerate(steps)):
            # --custom-megatron-before-train-step-hook-path
            hooks.before_train_step(args, rollout_id, step_id, self.model, self.optimizer, self.lr_scheduler)
            shard = self._dp_shard(batch, step)
            n_tokens = sum(float(sum(batch.loss_masks[i])) for i in shard)
            if args.calculate_per_token_loss:
                total = torch.tensor([n_tokens], dtype=torch.float64)
                dist.all_reduce(total, group=self.dp_group)
                normalizer = max(float(total.item()) / self.dp_size, 1.0)
            else:
                normalizer = float(len(shard))
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            step_loss = 0.0
            t = timer.mark()
            mbs = [self._pack(batch, mb_indices) for mb_indices in self._micro_batches(batch, shard)]
            t = timer.lap("pack", t)

            def on_logits(mb: D.PackedMicroBatch, logits) -> torch.Tensor:
                """The micro-batch's loss on the last pipeline stage (metrics accumulate there)."""
                nonlocal step_loss, counts, mismatch, mismatch_max
                logits, mtp_depths = logits if mtp else (logits, None)
                log_probs, entropy = D.response_log_probs(self._sampling_logits(logits), mb, ops,
                                                          args.log_probs_chunk_size)

                def cat(values):
                    return None if values is None else torch.cat([torch.as_tensor(values[i], dtype=torch.float32)
                                                                  for i in mb.sample_indices]).to(log_probs.device)

                loss_mask = mb.loss_mask.to(log_probs.device)
                rollout_lp = cat(batch.rollout_log_probs)
                # Same weights, same packing, same forward as compute_log_probs: its values, detached.
                old = log_probs.detach().float() if reuse else cat(batch.old_log_probs)
                if reuse and args.save_debug_train_data:  # the dump's old log-probs: this forward's
                    for i, part in zip(mb.sample_indices, D.split_per_sample(old.cpu(), mb.response_lengths)):
                        captured_old[i] = part
                if reuse and rollout_lp is not None:
                    diff = (old - rollout_lp).abs() * loss_mask
                    mismatch += torch.tensor([float(diff.sum()), float(loss_mask.sum())], dtype=torch.float64)
                    mismatch_max = torch.maximum(mismatch_max, torch.tensor([float(diff.max()) if diff.numel() else 0.0],
                                                                            dtype=torch.float64))
                if args.loss_type == "custom_loss":  # upstream's --custom-loss-function-path contract
                    from slime.backends.megatron.custom_loss import custom_loss

                    loss, m = custom_loss(args, batch, mb, self._sampling_logits(logits), normalizer,  # noqa: B023
                                          keys, old_log_probs=old)
                elif args.loss_type == "sft_loss":
                    loss, m = sft_loss(log_probs, loss_mask, mb.response_lengths, normalizer,  # noqa: B023
                                       args.calculate_per_token_loss, keys)
                else:
                    loss, m = rl_loss(self.loss_config, log_probs, entropy, old, cat(batch.advantages),
                                      loss_mask, mb.response_lengths, normalizer,  # noqa: B023 (runs within this step)
                                      ref_log_probs=cat(batch.ref_log_probs), rollout_log_probs=rollout_lp,
                                      hooks=self.loss_hooks,
                                      total_lengths=[len(batch.tokens[i]) for i in mb.sample_indices])
                if mtp:
                    loss_mtp, m["mtp_loss"] = self._mtp_loss(mb, mtp_depths, loss_mask, normalizer)  # noqa: B023
                    loss = loss + loss_mtp
                step_loss += float(loss.detach())
                for k in keys:
                    totals[k] += m[k]
                counts += torch.tensor([len(mb.sample_indices), float(mb.loss_mask.sum()), mb.num_tokens],
                                       dtype=torch.float64)
                return loss

            self._run_schedule(mbs, on_logits, forward_only=False, timer=timer, mtp_logits=mtp)
            timer.lap("backward", t)  # the schedule's time; its forward share is moved to "forward" below
            from slime.backends.megatron import model_setup

            t = timer.mark()
            lr = float(self.optimizer.param_groups[0]["lr"])  # this step's learning rate (--lr-decay-style)
            if args.use_stateless_adam:  # Adam from zero moments every step: upstream's StatelessAdam update
                from slime.backends.megatron.optimizer import reset_optimizer_states

                reset_optimizer_states(self.optimizer)
            grad_norm = model_setup.finish_step(self.model, self.optimizer, self.lr_scheduler,
                                                args.check_for_nan_in_loss_and_grad)
            timer.lap("optimizer", t)
            self.manual_gc.after_step()
            grad_norms.append(grad_norm)
            ci_checks.record_grad_norm(args, rollout_id, step_id, grad_norm, self.rank)  # --ci-save/load-grad-norm
            if step_id == 0 and args.ci_test and self.last_stage:
                local = counts[1] if args.calculate_per_token_loss else counts[0]
                ci_checks.check_first_step(args, rollout_id, step_id, totals["ppo_kl"] / max(float(local), 1.0),
                                           totals["kl"] / max(float(local), 1.0) if batch.ref_log_probs else None)
            loss_t = torch.tensor([step_loss], dtype=torch.float64)
            dist.all_reduce(loss_t, group=self.dp_group)
            losses.append(float(loss_t.item()) / self.dp_size)
        if captured_old and batch.old_log_probs is None:
            batch.old_log_probs = [captured_old.get(i) for i in range(len(batch))]
        seconds = timer.seconds()
        seconds["backward"] -= seconds["forward"]
        model_setup.sync_params(self.model)  # --overlap-param-gather: weight sync and save read the new weights
        self.profiler.step(rollout_id)
        elapsed = time.perf_counter() - t0

        # Metrics: sums over this DP rank, then over the data-parallel group; the last pipeline stage computed
        # them (and the loss), and hands them to the other stages.
        vec = torch.tensor([totals[k] for k in keys], dtype=torch.float64)
        vec = torch.cat([vec, counts])
        dist.all_reduce(vec, group=self.dp_group)
        if reuse and batch.rollout_log_probs is not None:
            dist.all_reduce(mismatch, group=self.dp_group)
            dist.all_reduce(mismatch_max, op=dist.ReduceOp.MAX, group=self.dp_group)
        vec, losses_t, mismatch, mismatch_max = self._from_last_stage(
            vec, torch.tensor(losses, dtype=torch.float64), mismatch, mismatch_max)
        losses = losses_t.tolist()
        n_samples, n_loss_tokens, n_tokens = vec[-3:].tolist()
        denom = n_loss_tokens if args.calculate_per_token_loss else n_samples
        metrics = {f"train/{k}": float(vec[j]) / max(denom, 1.0) for j, k in enumerate(keys)}
        metrics.update({
            "train/loss": sum(losses) / len(losses),
            "train/grad_norm": sum(grad_norms) / len(grad_norms),
            "train/steps": float(len(losses)),
            "train/lr": lr,
            "train/tokens": n_tokens,
            "perf/train_tokens_per_s": n_tokens / max(elapsed, 1e-9),
            "time/train": elapsed,
            "memory/train_peak_bytes": float(acc.memory_stats()["peak_allocated"]),
            **{f"time/train_{k}": v for k, v in seconds.items()},
        })
        if reuse and batch.rollout_log_probs is not None:
            # The driver's train_rollout_logprob_abs_diff (share_advantages over the whole rollout), from this forward.
            metrics["train_rollout_logprob_abs_diff"] = float(mismatch[0] / mismatch[1].clamp_min(1))
            metrics["train_rollout_logprob_abs_diff_max"] = float(mismatch_max[0])
        return metrics

    def _mtp_loss(self, mb: D.PackedMicroBatch, depth_logits: list, loss_mask: torch.Tensor,
                  normalizer: float) -> tuple[torch.Tensor, float]:
        """--enable-mtp-training: the MTP heads' loss on this micro-batch's response tokens (raw logits: the
        heads learn the model's next-next tokens, not the sampling distribution)."""
        from slime.backends.megatron.loss import mtp_loss

        ops = get_accelerator().ops
        lps, masks = [], []
        for k, logits in enumerate(depth_logits, start=1):
            lp, valid = D.mtp_log_probs(logits, mb, k, ops, chunk_size=self.args.log_probs_chunk_size)
            lps.append(lp)
            masks.append(loss_mask * valid.to(loss_mask.device))
        return mtp_loss(lps, masks, mb.response_lengths, normalizer, self.args.mtp_loss_scaling_factor,
                        self.args.calculate_per_token_loss)

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
        if getattr(self, "profiler", None) is not None:  # (set by init)
            self.profiler.close()
        if self.weight_sync is not None:
            self.weight_sync.close()
