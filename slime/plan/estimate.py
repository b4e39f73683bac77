"""One plan: memory per device in each RL phase (rollout, train, weight sync), fit, and a step-time lower bound.

Phases of a colocated run with offload alternate on the same devices, so the device peak is the
largest phase; without offload the trainer's state stays resident during rollout and adds up.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from slime.plan.devices import GB, TB, DeviceProfile
from slime.plan.fallbacks import fallback_ops
from slime.plan.layout import Layout, RolloutSettings, TrainSettings
from slime.plan.memory import TrainMemory, micro_batches_per_step, stage_layer_ranges, train_memory
from slime.plan.model import ModelShape


@dataclass(frozen=True)
class EngineMemory:
    weights: float  # bytes per engine device
    kv_pool: float  # bytes left for the KV cache under mem_fraction_static
    kv_bytes_per_token: float  # MLA latent (+ DSA indexer key), replicated over the engine's TP ranks
    kv_tokens: float  # tokens the pool holds (each sequence at full length with its recurrent state, if any)
    tokens_wanted: float  # all of an engine's samples at full length at once
    reserved: float  # what the engine claims up front (mem_fraction_static * capacity)
    state_bytes_per_sequence: float = 0.0  # KDA recurrent state + conv windows of one running sequence

    @property
    def concurrency(self) -> float:
        """Fraction of an engine's samples that fit in KV at full length simultaneously (>= 1: all)."""
        return self.kv_tokens / self.tokens_wanted if self.tokens_wanted else float("inf")


@dataclass(frozen=True)
class StepTime:
    rollout_s: float
    logprob_s: float
    train_s: float
    sync_s: float
    train_flops: float
    bound: str  # "compute" or "memory" for the train phase
    bubble: float = 0.0  # pipeline bubble: idle fraction of the log-prob and train phases, (pp-1)/(m+pp-1)
    cp_comm_s: float = 0.0  # context-parallel gathers / reduce-scatters inside logprob_s and train_s

    @property
    def total_s(self) -> float:
        return self.rollout_s + self.logprob_s + self.train_s + self.sync_s


@dataclass(frozen=True)
class Plan:
    model: ModelShape
    layout: Layout
    device: DeviceProfile
    train: TrainSettings
    rollout: RolloutSettings
    stages: list[TrainMemory]
    engine: EngineMemory
    sync_bucket: float  # bytes held on a trainer device while exporting one bucket
    micro_batches: int
    usable: float  # bytes of one device the plan may use
    phases: dict[str, float]  # phase -> peak bytes on a device
    time: StepTime
    problems: tuple[str, ...] = ()  # why it cannot run as configured (besides not fitting)

    @property
    def worst_stage(self) -> TrainMemory:
        return max(self.stages, key=lambda m: m.total)

    @property
    def peak(self) -> float:
        return max(self.phases.values()) if self.phases else 0.0

    @property
    def fits(self) -> bool:
        return not self.problems and self.peak <= self.usable and self.engine.kv_pool > 0


def engine_memory(model: ModelShape, rs: RolloutSettings, device: DeviceProfile, n_engines: int) -> EngineMemory:
    g = rs.devices_per_engine
    _, attn_rep = model.attention_totals(range(model.num_layers))
    replicated = (attn_rep + model.indexer_layers * model.indexer_params() + model.moe_layers * model.router_params()
                  + model.vision_params)
    sharded = model.total_param_count(with_mtp=False) - replicated
    weights = (sharded / g + replicated) * rs.weight_bytes
    reserved = rs.mem_fraction_static * device.memory_bytes
    kv_pool = reserved - weights
    per_token = model.kv_cache_bytes_per_token(rs.kv_bytes)
    # KDA layers: one recurrent state per running sequence, split over the engine's TP ranks by head
    state = model.linear_state_bytes_per_sequence() / g
    seq_len = rs.max_prompt_len + rs.max_response_len
    wanted = rs.samples / max(n_engines, 1) * seq_len
    tokens = max(kv_pool, 0.0) / (per_token + state / seq_len)
    return EngineMemory(weights, kv_pool, per_token, tokens, wanted, reserved, state)


def largest_export_tensor(model: ModelShape) -> int:
    """Elements of the largest HF tensor export gathers whole (embedding / lm_head rows over TP)."""
    return max(model.embedding_params(), model.head_params(), model.n_routed_experts * model.hidden_size)


def attention_flops_per_token(model: ModelShape, context: float) -> float:
    """Forward FLOPs per token per model for attention scores: causal mean context, DSA caps it at top-k."""
    ctx = context / 2
    eff = min(ctx, model.index_topk) if model.index_topk else ctx
    mla = 2 * model.num_heads * (model.qk_head_dim + model.v_head_dim) * eff * model.mla_layers
    # the indexer scores one compressed key per index_kpool tokens
    indexer = 2 * model.index_n_heads * model.index_head_dim * ctx / max(model.index_kpool, 1) * model.indexer_layers
    # KDA: per token and head, the state's decay, read (k, q) and rank-1 update: ~4 d x d multiply-adds
    kda = 2 * 4 * model.linear_num_heads * model.linear_head_dim ** 2 * len(model.linear_layer_ids)
    return mla + indexer + kda


def pipeline_bubble(pp: int, micro_batches: int) -> float:
    """Idle fraction of a 1F1B pass of m micro-batches over pp stages: (pp - 1) / (m + pp - 1)."""
    return (pp - 1) / (micro_batches + pp - 1)


def cp_bytes_per_token_layer(model: ModelShape, ts: TrainSettings, forward_only: bool) -> float:
    """Bytes one CP rank receives per local token, per layer and per (cp - 1) peers, in one pass: the forward
    all-gathers the MLA latent + rope key and the DSA indexer key; full recompute gathers again; the backward
    reduce-scatters the latent's grads (the indexer keys have none)."""
    latent = (model.kv_lora_rank + model.qk_rope_head_dim) * ts.act_bytes * model.mla_layers / model.num_layers
    index_key = model.index_head_dim * ts.act_bytes if model.indexer_layers else 0.0
    per_layer_fwd = latent + index_key * model.indexer_layers / model.num_layers
    if forward_only:
        return per_layer_fwd
    return per_layer_fwd * (2 if ts.recompute == "full" else 1) + latent


def cp_comm_seconds(model: ModelShape, layout: Layout, ts: TrainSettings, tokens: float, device: DeviceProfile,
                    forward_only: bool) -> float:
    """Time a device spends in CP collectives for `tokens` (all devices' tokens of the pass) on its stage's
    layers, at the device's link bandwidth (CP ranks are TP ranks apart: within a node when tp x cp fits)."""
    if layout.cp == 1:
        return 0.0
    local_tokens = tokens / (layout.dp * layout.cp)
    layers = max(len(r) for r in stage_layer_ranges(model.num_layers, layout.pp))
    layers += model.mtp_layers if ts.with_mtp else 0
    bytes_in = local_tokens * (layout.cp - 1) * layers * cp_bytes_per_token_layer(model, ts, forward_only)
    return bytes_in / (device.link_gb_s * GB)


def step_time(model: ModelShape, layout: Layout, ts: TrainSettings, rs: RolloutSettings, device: DeviceProfile,
              worst: TrainMemory, engine: EngineMemory, micro_batches: int, rollout_devices: int,
              sync_ipc: bool) -> StepTime:
    """Lower bound: each phase takes at least FLOPs / peak and bytes / bandwidth (whichever is larger)."""
    peak, hbm = device.bf16_tflops * TB, device.hbm_tb_s * TB
    seq_len = rs.max_prompt_len + rs.mean_response_len
    tokens = rs.samples * seq_len
    fwd_per_token = 2 * model.active_param_count() + attention_flops_per_token(model, seq_len)
    # Rollout: prefill + decode compute, and every decode step reads the engine's weights at least once
    # (RL batches are large enough to touch every expert).
    rollout_compute = fwd_per_token * tokens / (rollout_devices * peak)
    rollout_memory = rs.max_response_len * engine.weights / hbm
    rollout = max(rollout_compute, rollout_memory)
    # Pipeline passes idle (pp - 1) of every (m + pp - 1) slots (1F1B; the forward-only passes alike).
    stretch = 1 / (1 - pipeline_bubble(layout.pp, micro_batches))
    cp_logprob = rs.logprob_passes * cp_comm_seconds(model, layout, ts, tokens, device, forward_only=True)
    logprob = rs.logprob_passes * fwd_per_token * tokens / (layout.world * peak) * stretch + cp_logprob
    train_mult = 4 if ts.recompute == "full" else 3  # fwd + 2x bwd (+ recomputed fwd)
    train_flops = train_mult * fwd_per_token * tokens
    compute = train_flops / (layout.world * peak)
    weight_reads = micro_batches * (train_mult - 1) * worst.weights
    optimizer_traffic = 2 * (worst.weights + worst.grads + worst.optimizer)
    memory = (weight_reads + optimizer_traffic) / hbm
    # The CP gathers feed each layer's attention (on its critical path): added, not overlapped.
    cp_train = cp_comm_seconds(model, layout, ts, tokens, device, forward_only=False)
    train = max(compute, memory) * stretch + cp_train
    # Weight sync: each engine device receives its shard: a device copy with IPC, else over the links.
    sync = engine.weights / (hbm if sync_ipc else device.link_gb_s * GB)
    return StepTime(rollout, logprob, train, sync, train_flops, "compute" if compute >= memory else "memory",
                    pipeline_bubble(layout.pp, micro_batches), cp_logprob + cp_train)


def plan(model: ModelShape, layout: Layout, device: DeviceProfile, ts: TrainSettings | None = None,
         rs: RolloutSettings | None = None, usable_fraction: float = 0.92, reserve_gb: float = 4.0) -> Plan:
    """Estimate one layout. `usable_fraction` and `reserve_gb` leave room for the runtime, communicator
    buffers and allocator fragmentation, which the formulas do not model."""
    ts, rs = ts or TrainSettings(), rs or RolloutSettings()
    if ts.longest_sample is None:
        ts = replace(ts, longest_sample=rs.max_prompt_len + rs.max_response_len)
    if ts.fallback_ops is None:
        ts = replace(ts, fallback_ops=fallback_ops(device.key, model.model_type))
    problems = layout.problems(model)
    if problems:
        raise ValueError(f"layout {layout.short()} cannot run {model.name}: {'; '.join(problems)}")
    rollout_devices = rs.rollout_devices or layout.world
    if rollout_devices % rs.devices_per_engine:
        problems.append(f"rollout devices {rollout_devices} not divisible by devices per engine {rs.devices_per_engine}")
    n_engines = max(1, rollout_devices // rs.devices_per_engine)
    seq_len = rs.max_prompt_len + rs.mean_response_len
    step_samples = rs.global_batch_size or rs.samples
    micro = micro_batches_per_step(step_samples * seq_len, layout, ts, step_samples)
    stages = train_memory(model, layout, ts, micro)
    worst = max(stages, key=lambda m: m.total)
    engine = engine_memory(model, rs, device, n_engines)
    bucket = rs.update_weight_buffer_bytes + largest_export_tensor(model) * rs.weight_bytes
    sync_ipc = rs.colocate and device.ipc
    trainer_resident = worst.weights + (0 if rs.offload else worst.grads + worst.optimizer)
    phases = {"train": worst.total}
    if rs.colocate:
        phases["rollout"] = engine.reserved + (0 if rs.offload else worst.total)
        # Export runs with the trainer's weights resident and the engines' weights resumed (KV comes back after).
        engine_side = engine.weights if rs.offload else engine.reserved
        phases["sync"] = trainer_resident + bucket + engine_side + (0 if sync_ipc else rs.update_weight_buffer_bytes)
    else:
        phases["sync"] = worst.weights + worst.grads + worst.optimizer + bucket
        phases["rollout"] = engine.reserved + rs.update_weight_buffer_bytes
    usable = device.memory_bytes * usable_fraction - reserve_gb * GB
    time = step_time(model, layout, ts, rs, device, worst, engine, micro, rollout_devices, sync_ipc)
    if engine.kv_pool <= 0:
        problems.append(f"engine weights {engine.weights / GB:.1f} GB exceed mem_fraction_static "
                        f"{rs.mem_fraction_static} of {device.memory_gb:g} GB: use more devices per engine")
    return Plan(model, layout, device, ts, rs, stages, engine, bucket, micro, usable, phases, time, tuple(problems))
