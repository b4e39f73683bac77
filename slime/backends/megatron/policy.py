"""`PolicyModel`: the policy on one trainer rank.

It holds the rank's place in the model-parallel layout, the Megatron model with its optimizer and LR schedule,
the weight copies kept on the host (reference, on-policy-distillation teacher, --keep-old-actor) and the passes
over packed micro-batches: data-parallel sharding, micro-batching, packing, Megatron's schedule and the
response log-probs. The step runner (slime.backends.megatron.step_runner) trains it; the Ray actor
(slime.backends.megatron.actor) builds it and answers for it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from slime.accelerator import get_accelerator
from slime.backends.megatron import data as D
from slime.backends.megatron.checkpoint import torch_dist as ckpt
from slime.backends.megatron.checkpoint.layout import FoundCheckpoint
from slime.backends.megatron.timing import PhaseTimer

logger = logging.getLogger("slime.backends.megatron.actor")  # the actor's log lines keep their logger


class PolicyModel:
    def __init__(self, args, rank: int, world_size: int) -> None:
        """The rank's layout, read from Megatron's parallel state (after join_trainer_group); no model yet."""
        from megatron.core import parallel_state as mpu

        self.args, self.rank, self.world_size = args, rank, world_size
        self.device = get_accelerator().device()
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
        self.model = self.optimizer = self.lr_scheduler = None
        self.ref_weights: dict[str, torch.Tensor] | None = None
        self.teacher_weights: dict[str, torch.Tensor] | None = None
        self.old_actor = None
        self.profiler = None  # the actor's TrainProfiler, set once built

    # --- set-up (in this order: the RNG draws and the resumed state depend on it) ---------------
    def load(self, with_ref: bool) -> FoundCheckpoint | None:
        """The reference copy (with_ref), then the model (an HF directory as --load gives the initial weights)
        with its frozen parameters and optimizer; returns what --load holds (restored by `resume`)."""
        from slime.backends.megatron import model_setup
        from slime.backends.megatron.freeze import freeze_parameters

        args = self.args
        if with_ref:
            # The reference policy is held on the host and swapped in for its log-probs (no second model on device).
            ref_model = model_setup.load_reference(args)
            self.ref_weights = model_setup.host_copy(ref_model)
            del ref_model
        found = ckpt.find_checkpoint(args.load) if args.load else None
        self.model = model_setup.load_model(args, found.path if found and found.kind == ckpt.HF else args.hf_checkpoint)
        freeze_parameters(self.model, args.only_train_params_name_list, args.freeze_params_name_list)
        self.model, self.optimizer = model_setup.wrap_and_build_optimizer(args, self.model)
        return found

    def load_teacher_and_replay(self) -> None:
        """--use-opd --opd-type megatron: the teacher, held on the host like the reference; routing replay."""
        from slime.backends.megatron import model_setup

        args = self.args
        if args.use_opd and args.opd_type == "megatron":
            teacher = model_setup.load_reference(args, args.opd_teacher_load, "--opd-teacher-load")
            self.teacher_weights = model_setup.host_copy(teacher)
            del teacher
        if args.use_routing_replay:
            self._install_routing_replay()

    def resume(self, found: FoundCheckpoint | None) -> tuple[int, dict[str, Any] | None]:
        """The trainer checkpoint in --load restored onto the model and optimizer: (first rollout id, its
        extra state); (0, None) for none or HF weights."""
        args = self.args
        if found is None or found.kind in (ckpt.HF, ckpt.NONE):
            if found is not None:
                logger.info("--load %s: %s", args.load, "HF weights, starting at rollout 0" if found.kind == ckpt.HF
                            else "no checkpoint yet, starting from --hf-checkpoint")
            return 0, None
        resumed = ckpt.load(args.load, self.model, self.optimizer, self.rank, self.layout(),
                            ckpt.LoadOptions.from_args(args))
        logger.info("loaded %s (%s); starting at rollout %d", found.path, ", ".join(resumed.restored),
                    resumed.start_rollout_id)
        return resumed.start_rollout_id, resumed.extra_state

    def start_schedule(self, start_rollout_id: int) -> None:
        """The LR schedule (a pure function of the step: a resumed run starts it at its step) and, with
        --keep-old-actor, the old-actor copies of the loaded weights."""
        from slime.backends.megatron import model_setup

        self.lr_scheduler = model_setup.build_lr_scheduler(self.args, self.optimizer, start_rollout_id)
        if self.args.keep_old_actor:  # the loaded weights: actor, old_actor and rollout_actor start equal
            from slime.backends.megatron.old_actor import OldActor

            self.old_actor = OldActor(self.model, self.args.update_weights_interval)

    def layout(self) -> dict[str, int]:
        """The checkpoint's record of the parallel layout."""
        a = self.args
        layout = {"world_size": self.world_size, "tp": a.tensor_model_parallel_size,
                  "ep": a.expert_model_parallel_size, "pp": a.pipeline_model_parallel_size}
        if a.context_parallel_size > 1:  # (absent at CP 1: checkpoints from before CP keep their layout)
            layout["cp"] = a.context_parallel_size
        return layout

    def _install_routing_replay(self) -> None:
        from slime.backends.megatron.hf_export import unwrap
        from slime.utils import routing_replay
        from slime_plugins.models.common.model import install_routing_replay

        if install_routing_replay(self.model) == 0 and self.pp_size == 1:
            raise ValueError("--use-routing-replay / --use-rollout-routing-replay: the model has no MoE layer to "
                             "replay routes in; drop the flag")
        # the model runs sequence parallel whenever TP > 1: MoE layers then see their TP rank's slice of the tokens
        sp = bool(unwrap(self.model).config.sequence_parallel) and self.tp_size > 1
        routing_replay.REPLAY.layout = {"tp_rank": self.tp_rank, "sp_size": self.tp_size if sp else 1}

    def maybe_update_reference(self, rollout_id: int) -> bool:
        """--ref-update-interval N (upstream's): after every N-th rollout the reference policy becomes a copy of
        the actor's weights (host memory, as the reference is held)."""
        from slime.backends.megatron import model_setup

        interval = self.args.ref_update_interval
        if not interval or self.ref_weights is None or (rollout_id + 1) % interval:
            return False
        self.ref_weights = model_setup.host_copy(self.model)
        return True

    # --- forward --------------------------------------------------------------------------
    def sampling_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[T, V] logits of the sampling distribution: divided by the rollout temperature, so the actor's, old
        and reference log-probs are those the engines report for their samples (SGLang's default)."""
        logits = logits.reshape(-1, logits.shape[-1])
        temperature = self._temperature()
        if temperature == 1.0:
            return logits
        # No grad: in place, no second [T, V] copy. With grad the logits are a view made by a custom
        # autograd function, which autograd forbids modifying in place; the original is freed once replaced.
        return logits / temperature if torch.is_grad_enabled() else logits.div_(temperature)

    def _temperature(self) -> float:
        # Greedy rollouts (temperature 0) report log_softmax of the raw logits.
        t = float(self.args.rollout_temperature or 0.0)
        return t if t > 0 else 1.0

    def run_schedule(self, micro_batches: list[D.PackedMicroBatch], on_logits, forward_only: bool,
                     timer: PhaseTimer | None = None, mtp_logits: bool = False) -> None:
        """Megatron's schedule over the packed micro-batches; `on_logits(mb, logits)` runs on the last stage
        (with mtp_logits: `logits` is (logits, [MTP depth logits])). `timer` (when given) gets a "forward"
        span per forward computation (model and loss), from events."""
        from slime.backends.megatron import model_setup
        from slime.backends.megatron.pipeline import forward_backward
        from slime.utils.indexer_replay import INDEXER_REPLAY
        from slime.utils.routing_replay import REPLAY

        def timed(fn):
            if timer is None:
                return fn

            def run(*a):
                start = timer.mark()
                out = fn(*a)
                timer.lap("forward", start)
                return out
            return run

        def forward(m, mb):
            REPLAY.begin_micro_batch(mb)  # routing replay: the routes of this micro-batch (no-op when off)
            # --use-rollout-indexer-replay: the engine's DSA selections of this micro-batch (None when off)
            return model_setup.forward(m, mb, self.device, mtp_logits=mtp_logits,
                                       indexer_topk=INDEXER_REPLAY.selection(mb))

        forward_backward(self.model, micro_batches, timed(forward), timed(on_logits), forward_only)

    def from_last_stage(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
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

    # --- the rank's samples ---------------------------------------------------------------
    def dp_shard(self, batch: D.RolloutBatch, step: list[int]) -> list[int]:
        if self.args.balance_data:
            return D.balanced_dp_shard(step, [len(batch.tokens[i]) for i in step], self.dp_rank, self.dp_size)
        return D.dp_shard(step, self.dp_rank, self.dp_size)

    def _pad_multiple(self) -> int:
        # Sequence parallel splits the packed row over TP ranks; --data-pad-size-multiplier pads further;
        # context parallel cuts every sequence into 2*CP chunks and each rank's share must still split over TP.
        cp = 2 * self.cp_size if self.cp_size > 1 else 1
        return self.tp_size * self.args.data_pad_size_multiplier * cp

    def pack(self, batch: D.RolloutBatch, indices: list[int]) -> D.PackedMicroBatch:
        """One packed micro-batch; under context parallel with this CP rank's share attached."""
        mb = D.pack(batch, indices, self._pad_multiple(), cp_size=self.cp_size)
        if self.cp_size > 1:
            D.split_for_context_parallel(mb, self.cp_size, self.cp_rank, self.cp_group)
        return mb

    def my_samples(self, batch: D.RolloutBatch) -> list[int]:
        """Samples this rank trains on this rollout (its data-parallel shard of every step)."""
        mine: list[int] = []
        for step in D.batch_steps(batch, self.args.global_batch_size):
            mine.extend(self.dp_shard(batch, step))
        return mine

    def micro_batches(self, batch: D.RolloutBatch, indices: list[int],
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

    # --- log-probs ------------------------------------------------------------------------
    @torch.no_grad()
    def log_probs_of(self, batch: D.RolloutBatch, indices: list[int],
                     entropy: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
        """Per-sample response log-probs of `indices`, on every pipeline stage (the last computes them);
        `entropy` (when given) gets each sample's per-token entropy on the last stage."""
        out: dict[int, torch.Tensor] = {}
        ops = get_accelerator().ops
        zero = torch.zeros((), device=self.device)

        def on_logits(mb: D.PackedMicroBatch, logits: torch.Tensor) -> torch.Tensor:
            lp, ent = D.response_log_probs(self.sampling_logits(logits), mb, ops, self.args.log_probs_chunk_size)
            for i, part in zip(mb.sample_indices, D.split_per_sample(lp.float().cpu(), mb.response_lengths)):
                out[i] = part
            if entropy is not None:
                for i, part in zip(mb.sample_indices, D.split_per_sample(ent.float().cpu(), mb.response_lengths)):
                    entropy[i] = part
            return zero.clone()

        mbs = [self.pack(batch, mb_indices) for mb_indices in self._log_prob_groups(batch, indices)]
        with self.profiler.log_probs_pass():
            self.run_schedule(mbs, on_logits, forward_only=True)
        if self.pp_size == 1 or not indices:
            return out
        # The other stages need them too (advantages with a KL term, the train-rollout mismatch metric).
        lengths = [batch.response_lengths[i] for i in indices]
        flat = torch.cat([out[i] for i in indices]) if self.last_stage else torch.empty(sum(lengths))
        (flat,) = self.from_last_stage(flat)
        return dict(zip(indices, D.split_per_sample(flat.float(), lengths)))

    def _log_prob_groups(self, batch: D.RolloutBatch, indices: list[int]) -> list[list[int]]:
        from slime.utils.routing_replay import REPLAY

        if REPLAY.mode == "record":  # the training pass's micro-batches, so that it finds their recorded routes
            picked = set(indices)
            return [mb for step in D.batch_steps(batch, self.args.global_batch_size)
                    for mb in self.micro_batches(batch, [i for i in self.dp_shard(batch, step) if i in picked])]
        # no grad: --log-probs-max-tokens-per-gpu may pack more per micro-batch
        return self.micro_batches(batch, indices, self.args.log_probs_max_tokens_per_gpu)

    def compute_log_probs(self, batch: D.RolloutBatch) -> dict[str, Any]:
        """Old-policy (current weights) and reference log-probs of this rank's samples, no grad. With
        batch.reuse_train_log_probs only the reference's: training takes the old ones from its own forward."""
        from slime.backends.megatron import model_setup

        t0 = time.perf_counter()
        self.model.eval()
        indices = self.my_samples(batch)
        result = {}
        if not batch.reuse_train_log_probs:
            result["old_log_probs"] = self.log_probs_of(batch, indices)
        t_old = time.perf_counter() - t0
        if self.ref_weights is not None:
            with model_setup.swapped_weights(self.model, self.ref_weights):
                result["ref_log_probs"] = self.log_probs_of(batch, indices)
        keep = self.tp_rank == 0 and self.cp_rank == 0 and self.last_stage  # TP/CP ranks hold identical results
        total = time.perf_counter() - t0
        return {"log_probs": result if keep else {},
                "metrics": {"time/log_probs": total, "time/log_probs_old": t_old, "time/log_probs_ref": total - t_old}}

    def token_mean(self, values: list, batch: D.RolloutBatch, mine: list[int]) -> float:
        """Loss-masked token mean of per-sample `values` (the last stage's) over the data-parallel group,
        known on every stage."""
        import torch.distributed as dist

        acc = torch.zeros(2, dtype=torch.float64)
        for i in mine:
            if values[i] is not None:
                mask = torch.as_tensor(batch.loss_masks[i], dtype=torch.float64)
                acc += torch.stack([(values[i].double() * mask).sum(), mask.sum()])
        dist.all_reduce(acc, group=self.dp_group)
        (acc,) = self.from_last_stage(acc)
        return float(acc[0] / acc[1].clamp_min(1))
