"""Parallel layout and run settings the planner evaluates (names follow train.py's flags)."""

from __future__ import annotations

from dataclasses import dataclass

from slime.plan.model import ModelShape


@dataclass(frozen=True)
class Layout:
    """How the trainer is split over `nodes * devices_per_node` devices (Megatron semantics)."""

    nodes: int
    devices_per_node: int
    tp: int = 1  # --tensor-model-parallel-size
    pp: int = 1  # --pipeline-model-parallel-size
    ep: int = 1  # --expert-model-parallel-size
    cp: int = 1  # --context-parallel-size
    etp: int | None = 1  # --expert-tensor-parallel-size: 1 as train.py runs; None = tp (Megatron's default)
    sequence_parallel: bool | None = None  # default: on when tp > 1

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def sp(self) -> bool:
        return self.tp > 1 if self.sequence_parallel is None else self.sequence_parallel

    @property
    def dp(self) -> int:
        """Data-parallel size of the non-expert parameters."""
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def expert_dp(self) -> int:
        return self.world // (self.expert_tp * self.ep * self.pp)

    def problems(self, model: ModelShape) -> list[str]:
        """Why this layout cannot run `model` (empty when it can)."""
        out = []
        for name, v in (("nodes", self.nodes), ("devices_per_node", self.devices_per_node), ("tp", self.tp),
                        ("pp", self.pp), ("ep", self.ep), ("cp", self.cp), ("etp", self.expert_tp)):
            if v < 1:
                out.append(f"{name}={v} must be >= 1")
        if out:
            return out
        if self.world % (self.tp * self.pp * self.cp):
            out.append(f"world {self.world} not divisible by tp*pp*cp={self.tp * self.pp * self.cp}")
        if self.world % (self.expert_tp * self.ep * self.pp):
            out.append(f"world {self.world} not divisible by etp*ep*pp={self.expert_tp * self.ep * self.pp}")
        if model.n_routed_experts % self.ep:
            out.append(f"{model.n_routed_experts} experts not divisible by ep={self.ep}")
        if model.num_heads % self.tp:
            out.append(f"{model.num_heads} heads not divisible by tp={self.tp}")
        if self.pp > model.num_layers:
            out.append(f"pp={self.pp} exceeds {model.num_layers} layers")
        if model.moe_intermediate_size % self.expert_tp:
            out.append(f"moe_intermediate_size {model.moe_intermediate_size} not divisible by etp={self.expert_tp}")
        return out

    def short(self) -> str:
        s = f"tp{self.tp} pp{self.pp} ep{self.ep} cp{self.cp}"
        if self.expert_tp != self.tp:
            s += f" etp{self.expert_tp}"
        return s + f" dp{self.dp} ({self.nodes}x{self.devices_per_node})"


@dataclass(frozen=True)
class TrainSettings:
    max_tokens_per_gpu: int = 16384  # --max-tokens-per-gpu: tokens of one packed micro-batch per device
    recompute: str = "full"  # "none" | "full" (uniform, every layer)
    distributed_optimizer: bool = True  # optimizer state sharded over data parallel ranks
    optimizer_cpu_offload: bool = False  # optimizer state (and fp32 master weights) kept in host memory
    param_bytes: int = 2  # bf16 weights
    grad_bytes: int = 4  # fp32 main grads (Megatron grad buffer)
    master_bytes: int = 4  # fp32 master copy (0 when params are already fp32)
    adam_bytes: int = 8  # exp_avg + exp_avg_sq in fp32
    act_bytes: int = 2  # bf16 activations
    logits_bytes: int = 6  # per logit: bf16 output + fp32 working copy for the log-softmax
    with_mtp: bool = True  # MTP layers trained (train.py --enable-mtp-training; without it plan with --no-mtp)
    moe_imbalance: float = 1.0  # routed tokens per rank relative to the balanced mean
    # Tokens of the longest sample (prompt + max response): one longer than a micro-batch's budget
    # (max_tokens_per_gpu x cp) is a micro-batch of its own, split over CP. None: not considered.
    longest_sample: int | None = None
    # Ops that run on the pure-torch reference on the planned device (slime/plan/fallbacks.py); None: derived from
    # the device and model by plan(), () for none.
    fallback_ops: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.recompute not in ("none", "full"):
            raise ValueError(f"recompute={self.recompute!r}: use 'none' or 'full'")
        if self.max_tokens_per_gpu < 1:
            raise ValueError(f"max_tokens_per_gpu={self.max_tokens_per_gpu} must be >= 1")


@dataclass(frozen=True)
class RolloutSettings:
    rollout_batch_size: int = 64  # --rollout-batch-size (prompts per rollout)
    n_samples_per_prompt: int = 8  # --n-samples-per-prompt
    max_prompt_len: int = 2048
    max_response_len: int = 8192  # --rollout-max-response-len
    avg_response_len: int | None = None  # default: half the max
    devices_per_engine: int = 8  # --rollout-num-gpus-per-engine
    rollout_devices: int | None = None  # --rollout-num-gpus; None = the trainer's devices (colocated)
    colocate: bool = True
    offload: bool = True  # --offload-train / --offload-rollout: phases do not hold each other's memory
    mem_fraction_static: float = 0.8  # --sglang-mem-fraction-static: engine weights + KV pool
    weight_bytes: int = 2
    kv_bytes: float = 2.0  # bf16 latent cache (1 for an fp8 cache)
    update_weight_buffer_bytes: int = 1 << 30  # --update-weight-buffer-size
    logprob_passes: int = 2  # extra forward passes per step: old policy + reference
    global_batch_size: int | None = None  # samples per optimizer step; default: the whole rollout

    @property
    def samples(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def mean_response_len(self) -> int:
        return self.avg_response_len if self.avg_response_len is not None else self.max_response_len // 2
