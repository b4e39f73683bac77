"""Per-device memory of the trainer (weights, grads, optimizer state, activations) on one pipeline stage.

Sharding model (Megatron): attention up/out projections, dense MLPs, shared experts, embedding and
head are split by TP; low-rank down projections, norms, routers and DSA indexers are replicated over
TP; routed experts are split over EP (whole experts) and expert-TP (inside an expert). The
distributed optimizer shards fp32 master weights + Adam moments over the data-parallel ranks
(expert-data-parallel ranks for expert parameters). Every formula is per device, in bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from slime.plan import fallbacks
from slime.plan.layout import Layout, TrainSettings
from slime.plan.model import ModelShape


@dataclass(frozen=True)
class StageParams:
    """Parameter elements of one pipeline stage, by how they are sharded."""

    tp_sharded: int  # split over tp
    replicated: int  # full copy on every tp rank
    expert: int  # split over ep * etp
    dense_layers: int
    moe_layers: int
    indexer_layers: int
    has_embedding: bool
    has_head: bool
    mtp_layers: int
    linear_layers: int = 0  # KDA layers among dense_layers + moe_layers (the others are MLA)
    frozen: int = 0  # vision tower on the first stage: weights only (no grads, no optimizer state)

    def per_device(self, layout: Layout) -> float:
        return self.tp_sharded / layout.tp + self.replicated + self.expert / (layout.ep * layout.expert_tp)

    def non_expert_per_device(self, layout: Layout) -> float:
        return self.tp_sharded / layout.tp + self.replicated

    def expert_per_device(self, layout: Layout) -> float:
        return self.expert / (layout.ep * layout.expert_tp)


def stage_layer_ranges(num_layers: int, pp: int) -> list[range]:
    """Contiguous split; the first `num_layers % pp` stages take one extra layer."""
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def stage_params(model: ModelShape, pp: int, stage: int, with_mtp: bool = True) -> StageParams:
    layers = stage_layer_ranges(model.num_layers, pp)[stage]
    n_dense = sum(1 for i in layers if i < model.dense_layers)
    n_moe = len(layers) - n_dense
    # Indexer layers where the config lists them, else spread evenly (exact when pp == 1 or every layer runs one).
    n_index = model.indexers_in(layers)
    stage_tp, stage_rep = model.attention_totals(layers)
    attn_tp, attn_rep = model.attention_params()  # an MTP layer's (MLA)
    tp = stage_tp + n_dense * model.dense_mlp_params() + n_moe * model.shared_expert_params()
    rep = stage_rep + n_moe * model.router_params() + n_index * model.indexer_params()
    expert = n_moe * model.n_routed_experts * model.expert_params()
    first, last = stage == 0, stage == pp - 1
    mtp = model.mtp_layers if (with_mtp and last) else 0
    if first:
        tp += model.embedding_params()
    if last:
        tp += model.head_params()
        rep += model.hidden_size  # final norm
        # A later stage that needs the embedding (tied head, MTP) keeps its own copy.
        if not first and (model.tie_word_embeddings or mtp):
            tp += model.embedding_params()
    if mtp:
        tp += mtp * (attn_tp + model.shared_expert_params() + 2 * model.hidden_size ** 2)
        rep += mtp * (attn_rep + model.router_params() + model.indexer_params() + 3 * model.hidden_size)
        expert += mtp * model.n_routed_experts * model.expert_params()
    return StageParams(tp, rep, expert, n_dense, n_moe, n_index, first, last, mtp,
                       linear_layers=sum(1 for i in layers if model.is_linear(i)),
                       frozen=model.vision_params if first else 0)


@dataclass(frozen=True)
class TrainMemory:
    stage: int
    params: float  # elements on this device
    weights: float  # bytes
    grads: float
    optimizer: float  # on device
    optimizer_host: float  # in host memory (CPU offload)
    activations: float
    micro_batches_in_flight: int

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations


def optimizer_state_bytes(sp: StageParams, layout: Layout, ts: TrainSettings) -> float:
    """fp32 master + Adam moments; sharded over (expert-)data-parallel ranks by the distributed optimizer."""
    per_param = ts.master_bytes + ts.adam_bytes
    dense, expert = sp.non_expert_per_device(layout), sp.expert_per_device(layout)
    if ts.distributed_optimizer:
        return per_param * (dense / layout.dp + expert / layout.expert_dp)
    return per_param * (dense + expert)


def tokens_per_device(layout: Layout, ts: TrainSettings) -> int:
    """Tokens of one micro-batch on one device: --max-tokens-per-gpu (a micro-batch packs up to CP times
    as many, split over the CP ranks), or the longest sample's share when that sample alone exceeds it."""
    longest = ts.longest_sample or 0
    return max(ts.max_tokens_per_gpu, math.ceil(longest / layout.cp))


def cp_gathered_elements(model: ModelShape, layout: Layout) -> float:
    """Context parallel, per local token per layer: what the (cp - 1) other ranks' tokens add to the saved
    activations. MLA all-gathers their compressed latent + rope key and up-projects k / v for them locally
    (kept for the attention backward); the DSA indexer's gathered keys have no grad and are not kept."""
    if layout.cp == 1:
        return 0.0
    latent = model.kv_lora_rank + model.qk_rope_head_dim
    kv = model.num_heads * (model.qk_head_dim + model.qk_nope_head_dim + model.v_head_dim) / layout.tp
    return (layout.cp - 1) * (latent + kv)


def linear_attention_activation_elements(model: ModelShape, layout: Layout) -> float:
    """Saved-for-backward elements per token of one KDA block (head-split over tp): q/k/v before and after
    their convs, the per-channel forget gate (fp32: 2 bf16 units), beta, the output gate, the delta-rule
    output and the gated norm's output; the rank-d gate inputs are whole. The chunk states are rebuilt in
    the backward (fla's chunk_kda and the torch reference keep none per token)."""
    H, d = model.linear_num_heads, model.linear_head_dim
    return (6 * H * d + 2 * H * d + H + 3 * H * d) / layout.tp + 2 * d


def mhc_activation_elements(model: ModelShape, layout: Layout) -> float:
    """mHC per layer and token, two blocks: the hc_mult streams read by the mixer in fp32 (2 units each), and
    the mixed streams written back; sequence-split like the hidden states."""
    if model.hc_mult <= 1:
        return 0.0
    seq = layout.tp if layout.sp else 1
    return 2 * 3 * model.hc_mult * model.hidden_size / seq


def layer_activation_elements(model: ModelShape, layout: Layout, ts: TrainSettings, moe: bool,
                              indexer: bool, linear: bool = False) -> float:
    """Saved-for-backward activation elements per token of one layer without recompute.

    Sequence-region tensors (norm inputs/outputs) are split over tp only with sequence parallel;
    head-split tensors over tp; replicated low-rank tensors are whole on every tp rank; with CP, the keys
    and values of the other CP ranks' tokens (cp_gathered_elements).
    """
    h, H, tp = model.hidden_size, model.num_heads, layout.tp
    seq = tp if layout.sp else 1
    elems = 4 * h / seq + mhc_activation_elements(model, layout)  # input norm in/out, post-attention norm in/out
    if linear:
        elems += linear_attention_activation_elements(model, layout)
    else:
        elems += (2 * model.q_lora_rank) + (model.kv_lora_rank + model.qk_rope_head_dim) + model.kv_lora_rank
        # q, k (rope'd), kv_b output, attention output, fp32 softmax statistics (2 bf16 units per head)
        elems += H * (2 * model.qk_head_dim + model.qk_nope_head_dim + 2 * model.v_head_dim + 2) / tp
        elems += cp_gathered_elements(model, layout)
    if indexer:
        elems += 2 * model.index_topk  # int32 top-k indices kept for the sparse attention backward
    if moe:
        k, i_moe, etp = model.top_k, model.moe_intermediate_size, layout.expert_tp
        gather = etp if layout.sp else 1  # expert-TP gathers the TP ranks' tokens
        routed_tokens = k * ts.moe_imbalance * gather / seq
        elems += 4 * model.n_routed_experts / seq  # fp32 router logits + scores
        elems += routed_tokens * (2 * h + 3 * i_moe / etp)  # dispatched in, fc1 out (gate|up), act, fc2 out
        elems += 3 * model.moe_intermediate_size * model.n_shared_experts / tp + h / seq
    else:
        elems += 3 * model.intermediate_size / tp
    return elems


def activation_bytes(model: ModelShape, layout: Layout, ts: TrainSettings, sp: StageParams,
                     micro_batches: int, stage: int) -> tuple[float, int]:
    """(bytes, micro-batches in flight) for one stage under 1F1B: stage s holds min(pp - s, m) micro-batches."""
    T, ab = tokens_per_device(layout, ts), ts.act_bytes
    seq = layout.tp if layout.sp else 1
    in_flight = max(1, min(layout.pp - stage, micro_batches))
    dense = layer_activation_elements(model, layout, ts, moe=False, indexer=False)
    moe = layer_activation_elements(model, layout, ts, moe=True, indexer=False)
    idx_extra = 2 * model.index_topk
    layers_full = sp.dense_layers * dense + sp.moe_layers * moe + sp.indexer_layers * idx_extra
    if sp.linear_layers:  # KDA in place of MLA on these layers (the MLP part is the same)
        kda = layer_activation_elements(model, layout, ts, moe=True, indexer=False, linear=True)
        layers_full += sp.linear_layers * (kda - moe)
    layers_full += sp.mtp_layers * (moe + (idx_extra if model.index_n_heads else 0) + 2 * model.hidden_size / seq)
    n_layers = sp.dense_layers + sp.moe_layers + sp.mtp_layers
    # Ops on the pure-torch reference (no device kernel) keep more than the kernels: slime/plan/fallbacks.py.
    kda_fallback = fallbacks.layer_bytes(model, layout, ts, T, linear=True) / ab if sp.linear_layers else 0.0
    mla_fallback = fallbacks.layer_bytes(model, layout, ts, T, linear=False) / ab
    layers_full += sp.linear_layers * kda_fallback + (n_layers - sp.linear_layers) * mla_fallback
    if ts.recompute == "full":
        # Only each layer's input is kept (all hc_mult mHC streams); one layer at a time is rebuilt.
        stored = n_layers * model.hc_mult * model.hidden_size / seq
        working = max(dense if sp.dense_layers else 0, moe + idx_extra if (sp.moe_layers or sp.mtp_layers) else 0)
        working += max(kda_fallback, mla_fallback)
        per_mb = stored
    else:
        per_mb, working = layers_full, 0.0
    total = in_flight * per_mb * T * ab + working * T * ab
    if sp.has_embedding:
        total += in_flight * T * model.hc_mult * model.hidden_size / seq * ab
    if sp.has_head:  # logits of the last micro-batch (and of each MTP head)
        total += (1 + sp.mtp_layers) * T * model.vocab_size / layout.tp * ts.logits_bytes
    return total, in_flight


def train_memory(model: ModelShape, layout: Layout, ts: TrainSettings, micro_batches: int) -> list[TrainMemory]:
    """Memory of one device on every pipeline stage (the planner reports the largest)."""
    out = []
    for stage in range(layout.pp):
        sp = stage_params(model, layout.pp, stage, ts.with_mtp)
        n = sp.per_device(layout)
        opt = optimizer_state_bytes(sp, layout, ts)
        act, in_flight = activation_bytes(model, layout, ts, sp, micro_batches, stage)
        out.append(TrainMemory(
            stage=stage, params=n + sp.frozen, weights=(n + sp.frozen) * ts.param_bytes, grads=n * ts.grad_bytes,
            optimizer=0.0 if ts.optimizer_cpu_offload else opt, optimizer_host=opt if ts.optimizer_cpu_offload else 0.0,
            activations=act, micro_batches_in_flight=in_flight,
        ))
    return out


def micro_batches_per_step(tokens_per_step: float, layout: Layout, ts: TrainSettings,
                           samples_per_step: int | None = None) -> int:
    """Packed micro-batches each data-parallel rank runs per optimizer step (dynamic batch size): the step's
    tokens over the budget of max_tokens_per_gpu x cp, or one per sample when the mean sample exceeds it."""
    budget = layout.dp * layout.cp * ts.max_tokens_per_gpu
    if samples_per_step and tokens_per_step / samples_per_step > layout.cp * ts.max_tokens_per_gpu:
        return max(1, math.ceil(samples_per_step / layout.dp))
    return max(1, math.ceil(tokens_per_step / budget))
