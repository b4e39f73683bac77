"""The resolved run configuration, typed and read-only: what validation decided from the flags, per concern.

`slime.config.validation.validate_args` builds it last (`args.run_config`), once every default that depends on
other flags is filled and every "auto" is decided, so a reader gets the run's values without re-deriving them:
the checkpoint's config.json as read once, the trainer's layout, the rollout engine that runs, the batch
arithmetic, the checkpoints. The flags stay on `args` under their names (upstream's plugins read them there);
these are the same values, and `check_matches(args)` says which ones changed since (nothing may)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    hf_checkpoint: str
    hf_config: dict[str, Any] | None  # --hf-checkpoint's config.json, read once by validation (None: missing)
    model_type: str | None
    bf16: bool


@dataclass(frozen=True)
class ParallelConfig:
    world_size: int  # trainer ranks: --actor-num-nodes x --actor-num-gpus-per-node
    data_parallel_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    context_parallel_size: int
    expert_model_parallel_size: int
    expert_tensor_parallel_size: int
    sequence_parallel: bool


@dataclass(frozen=True)
class RolloutConfig:
    engine: str  # --rollout-engine as given (auto, embedded, sglang)
    engine_kind: str | None  # the engine that runs ("auto" resolved; None only without a usable accelerator)
    router: str
    num_gpus: int  # devices of all engines (0 with --debug-train-only)
    num_gpus_per_engine: int
    num_gpus_per_node: int
    colocate: bool
    offload_train: bool
    offload_rollout: bool
    batch_size: int | None  # prompt groups per rollout
    n_samples_per_prompt: int
    max_prompt_len: int | None
    max_context_len: int | None


@dataclass(frozen=True)
class TrainingConfig:
    num_rollout: int
    global_batch_size: int
    num_steps_per_rollout: int
    micro_batch_size: int
    use_dynamic_batch_size: bool
    max_tokens_per_gpu: int | None
    use_ref_model: bool  # a KL term or KL reward shaping needs the reference policy's log-probs
    update_weight_mode: str  # as given; the trainer's weight sync resolves "auto" against its engines


@dataclass(frozen=True)
class CheckpointConfig:
    load: str | None
    save: str | None
    save_interval: int | None
    save_hf: str | None
    ref_load: str | None  # an iteration directory when --ref-ckpt-step named one; --hf-checkpoint by default
    async_save: bool
    finetune: bool


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    parallel: ParallelConfig
    rollout: RolloutConfig
    training: TrainingConfig
    checkpoint: CheckpointConfig

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunConfig:
        """From a validated namespace (validate_args fills every field read here)."""
        hf = args.hf_config
        return cls(
            model=ModelConfig(args.hf_checkpoint, hf, hf.get("model_type") if hf else None, args.bf16),
            parallel=ParallelConfig(
                args.world_size, args.data_parallel_size, args.tensor_model_parallel_size,
                args.pipeline_model_parallel_size, args.context_parallel_size, args.expert_model_parallel_size,
                args.expert_tensor_parallel_size, args.sequence_parallel),
            rollout=RolloutConfig(
                args.rollout_engine, args.rollout_engine_kind, args.rollout_router, args.rollout_num_gpus,
                args.rollout_num_gpus_per_engine, args.num_gpus_per_node, args.colocate, args.offload_train,
                args.offload_rollout, args.rollout_batch_size, args.n_samples_per_prompt, args.rollout_max_prompt_len,
                args.rollout_max_context_len),
            training=TrainingConfig(
                args.num_rollout, args.global_batch_size, args.num_steps_per_rollout, args.micro_batch_size,
                args.use_dynamic_batch_size, args.max_tokens_per_gpu, args.use_ref_model, args.update_weight_mode),
            checkpoint=CheckpointConfig(
                args.load, args.save, args.save_interval, args.save_hf, args.ref_load, args.async_save, args.finetune),
        )

    def check_matches(self, args: argparse.Namespace) -> list[str]:
        """Fields whose flag on `args` no longer holds the resolved value, as "concern.field": empty when
        nothing rewrote a resolved flag after validation."""
        fresh = RunConfig.from_args(args)
        return [f"{part.name}.{f.name}" for part in dataclasses.fields(self)
                for f in dataclasses.fields(getattr(self, part.name))
                if getattr(getattr(self, part.name), f.name) != getattr(getattr(fresh, part.name), f.name)]
