"""The decoder-only language model every family builds on megatron-core: vocab-parallel embedding, a
TransformerBlock of the family's layer specs, final RMSNorm, vocab-parallel output layer (logits gathered
over TP by default; the embedding table itself when the checkpoint ties them)."""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock

from slime.accelerator import get_accelerator
from slime_plugins.models.common.rope import ForwardContext, RotaryTable
from slime_plugins.models.common.spec import block_spec
from slime_plugins.models.common.tensor_parallel_attributes import mark_tensor_parallel_params


def cu_seqlens_for(batch: int, seq_len: int, packed_seq_params: PackedSeqParams | None, device) -> torch.Tensor:
    """Sequence boundaries in THD order: from packed_seq_params (B must be 1), else one sequence per row.
    Under context parallel (ContextParallelSeqParams) these are the local chunks' query segments."""
    if packed_seq_params is None:
        return torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device=device)
    if packed_seq_params.qkv_format != "thd" or batch != 1:
        raise ValueError(f"packed_seq_params need qkv_format='thd' and input_ids [1, T]; got "
                         f"{packed_seq_params.qkv_format!r} with batch {batch}")
    cu = packed_seq_params.cu_seqlens_q
    if packed_seq_params.cu_seqlens_kv is not None and not torch.equal(cu, packed_seq_params.cu_seqlens_kv):
        raise ValueError("self-attention needs cu_seqlens_q == cu_seqlens_kv")
    return cu.to(device=device, dtype=torch.int32)


class DecoderModel(MegatronModule):
    """forward(input_ids [B, S], position_ids [B, S], attention_mask=None, packed_seq_params=None)
    -> logits [B, S, V] on the last pipeline stage (full vocab when gather_logits), else hidden states
    [S(/tp), B, H] for the next stage. attention_mask must be None: attention is causal within each
    sequence (rows of a batch, or the cu_seqlens segments of a packed [1, T] batch).

    `arch` is the family's architecture dataclass (see common/config.py for what this model reads),
    `attention` the family's self-attention module class, `mtp_block` (optional) builds the family's
    multi-token-prediction block as mtp_block(config, arch)."""

    def __init__(self, arch, config, attention: type, pre_process: bool | None = None, post_process: bool | None = None,
                 gather_logits: bool = True, vp_stage: int | None = None, mtp_block=None) -> None:
        super().__init__(config=config)
        from megatron.core.enums import ModelType

        self.model_type = ModelType.encoder_or_decoder  # read by megatron's pipeline schedules
        self.arch = arch
        self.gather_logits = gather_logits
        self.pre_process = ps.is_pipeline_first_stage() if pre_process is None else pre_process
        self.post_process = ps.is_pipeline_last_stage() if post_process is None else post_process
        tied = bool(arch.tie_word_embeddings)
        if tied and not (self.pre_process and self.post_process):
            raise ValueError(f"{arch.model_type}: tie_word_embeddings=True needs the embedding and the output layer on "
                             "one stage; use pipeline parallel size 1 for this checkpoint")
        self.share_embeddings_and_output_weights = tied  # read by finalize_model_grads
        self.rotary = RotaryTable(arch)
        if self.pre_process:
            self.embedding = tensor_parallel.VocabParallelEmbedding(
                arch.vocab_size, arch.hidden_size, init_method=config.init_method, config=config)
        self.decoder = TransformerBlock(config, block_spec(arch, config, attention, vp_stage=vp_stage),
                                        pre_process=self.pre_process, post_process=self.post_process, vp_stage=vp_stage)
        if self.post_process:
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                arch.hidden_size, arch.vocab_size, config=config, init_method=config.init_method, bias=False,
                gather_output=False, skip_bias_add=False, skip_weight_param_allocation=tied)
        if mtp_block is not None and self.post_process:
            # MTP runs on the last stage (set only there: megatron's schedules walk `model.mtp.layers[i]`). It
            # embeds tokens too, so under PP the last stage keeps its own copy of the embedding, as Megatron
            # does: loaded with the same values, and finalize_model_grads all-reduces the two copies' grads
            # over the embedding group (first + last stage; it does so when config.mtp_num_layers is set).
            if not config.mtp_num_layers:
                raise ValueError("a model with MTP layers needs config.mtp_num_layers (the embedding grads of "
                                 "the first and last pipeline stages are summed only then)")
            if not self.pre_process:
                self.embedding = tensor_parallel.VocabParallelEmbedding(
                    arch.vocab_size, arch.hidden_size, init_method=config.init_method, config=config)
                self.embedding.weight.shared = True  # the grad norm counts the first stage's copy only
            self.mtp = mtp_block(config, arch)
        if config.mtp_num_layers and config.pipeline_model_parallel_size > 1 and hasattr(self, "embedding"):
            # Both copies get a grad bucket of their own (megatron's DDP, distributed optimizer), so they are
            # split over the data-parallel ranks alike and the embedding-group all-reduce after the DP
            # reduce-scatter adds matching shards.
            self.embedding.weight.shared_embedding = True
        self.passthrough_hf: dict[str, torch.Tensor] = {}  # checkpoint tensors kept unchanged for export

    @property
    def family(self):
        """The registry entry of this model's architecture (weight maps, HF names)."""
        from slime_plugins.models.registry import get_family

        return get_family(self.arch.model_type)

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S(/tp), B, H] -> this TP rank's vocab slice of the logits [S, B, V / tp]."""
        weight = self.embedding.weight if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden, weight=weight)
        return logits

    @property
    def holds_embedding_copy(self) -> bool:
        """The last stage's copy of the first stage's embedding (MTP under PP)."""
        return not self.pre_process and hasattr(self, "embedding")

    def shared_embedding_or_output_weight(self):
        """The embedding weight held by the first stage and, with MTP under PP, by the last stage (what
        megatron's finalize_model_grads all-reduces over the embedding group)."""
        return self.embedding.weight if hasattr(self, "embedding") else None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """megatron's distributed-checkpoint view. Layers need not be alike (dense / MoE, DSA full / shared):
        each is stored under its global index (decoder.layers.{i}.*), which also lets a checkpoint load at
        another pipeline split. TP / EP shards: megatron's parallel layers, SwiGLUMLP and GroupedExperts.
        The last stage's embedding copy is a replica of the first stage's (saved by the first, loaded by both)."""
        metadata = {"non_homogeneous_layers": True, **(metadata or {})}  # False: megatron's stacked layer form
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.holds_embedding_copy:
            copy = out[f"{prefix}embedding.weight"]
            rid = copy.replica_id
            copy.replica_id = (1, *rid[1:]) if isinstance(rid, tuple) else rid + 1  # never the main replica
        return out

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline schedules hand the previous stage's output here."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None, mtp_logits: bool = False,
                mtp_input_ids: list[torch.Tensor] | None = None,
                indexer_topk: tuple[torch.Tensor, torch.Tensor] | None = None, **_: object):
        """mtp_logits=True (model built with MTP): returns (logits, [logits of MTP depth k = 1..]), where
        depth k's row t predicts token t + k + 1 of the same sequence. Under context parallel the rows are this
        rank's chunks, so the ids k tokens ahead come from the whole pack: `mtp_input_ids` [B, S] per depth.
        `indexer_topk`: the rollout's DSA selections of these rows (ForwardContext.indexer_topk)."""
        if attention_mask is not None:
            raise ValueError("attention_mask is not supported: pass packed_seq_params (cu_seqlens) to separate samples")
        if input_ids.dim() != 2 or position_ids.shape != input_ids.shape:
            raise ValueError(f"input_ids and position_ids must both be [B, S]; got {tuple(input_ids.shape)}, "
                             f"{tuple(position_ids.shape)}")
        batch, seq_len = input_ids.shape
        tp = self.config.tensor_model_parallel_size
        if self.config.sequence_parallel and seq_len % tp:
            raise ValueError(f"sequence length {seq_len} must be a multiple of tp={tp} (sequence parallel); pad the batch")
        device = input_ids.device
        cos, sin = self.rotary(position_ids, self.config.params_dtype)
        cu = cu_seqlens_for(batch, seq_len, packed_seq_params, device)
        cp = getattr(packed_seq_params, "context_parallel", None)
        if cp is not None:
            cp = cp.to(device)
            if mtp_logits and mtp_input_ids is None:
                raise ValueError("MTP logits under context parallel need mtp_input_ids (the ids k tokens ahead of "
                                 "each local row, taken from the whole pack: a chunk's next tokens are another rank's)")
        ctx = ForwardContext(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cos=cos, sin=sin, cu_seqlens=cu,
                             batch=batch, seq_len=seq_len, cp=cp, indexer_topk=indexer_topk)
        hidden = None
        if self.pre_process:
            hidden = self.embedding(input_ids).transpose(0, 1).contiguous()  # [S, B, H]
            if self.config.sequence_parallel:
                hidden = tensor_parallel.scatter_to_sequence_parallel_region(hidden)
        hidden = self.decoder(hidden_states=hidden, attention_mask=None, packed_seq_params=ctx)
        if not self.post_process:
            return hidden
        logits = self.output_logits(hidden)  # [S, B, V / tp]
        if not mtp_logits:
            return self._finish_logits(logits)
        if getattr(self, "mtp", None) is None:
            raise ValueError("mtp_logits=True needs a model built with MTP (load_hf_model(..., load_mtp=True))")
        extra = self.mtp(self, input_ids, hidden, ctx, shifted_ids=mtp_input_ids)
        return self._finish_logits(logits), [self._finish_logits(x) for x in extra]

    def _finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.gather_logits:
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
        return logits.transpose(0, 1).contiguous()


def set_selective_recompute(model: torch.nn.Module, config) -> None:
    """Selective recompute of our MoE layers as megatron means it: `moe` recomputes the whole MoE layer
    (through TransformerLayer's mlp checkpoint), `mlp` only dense MLPs. megatron's TransformerLayer tells MoE
    layers apart by its own MoELayer class, so it would treat ours as dense MLPs."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from slime_plugins.models.common.moe import MoELayer

    if config.recompute_granularity != "selective":
        return
    for layer in model.modules():
        if isinstance(layer, TransformerLayer) and isinstance(layer.mlp, MoELayer):
            layer.recompute_mlp = "moe" in config.recompute_modules


def build_model(arch, attention: type, tp: int = 1, ep: int = 1, pp: int = 1, dtype: torch.dtype = torch.float32,
                perform_initialization: bool = False, gather_logits: bool = True, mtp_block=None,
                **config_overrides) -> DecoderModel:
    """This rank's DecoderModel shard on the accelerator (megatron model parallel must be initialized)."""
    arch.check_parallel(tp, ep)
    cp = ps.get_context_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    if cp > 1:  # megatron's schedules and DDP read it (loss x CP, grads averaged over DP x CP)
        config_overrides.setdefault("context_parallel_size", cp)
    config = arch.transformer_config(tp, ep, pp, dtype=dtype, perform_initialization=perform_initialization,
                                     **config_overrides)
    model = DecoderModel(arch, config, attention, gather_logits=gather_logits, mtp_block=mtp_block)
    set_selective_recompute(model, config)
    mark_tensor_parallel_params(model)  # megatron sets them only when it initialises weights itself
    return model.to(get_accelerator().device())


def install_routing_replay(model: torch.nn.Module) -> int:
    """Give each decoder MoE layer its global layer index (`replay_layer`, the engine's layer numbering; read by
    slime.utils.routing_replay's REPLAY); returns how many there are. MTP layers keep None: they route by
    themselves."""
    from slime_plugins.models.common.moe import MoELayer

    count = 0
    for module in model.modules():
        if not isinstance(module, DecoderModel):
            continue
        for layer in module.decoder.layers:
            if isinstance(getattr(layer, "mlp", None), MoELayer):  # TransformerLayer, or glm5_next's own layer
                layer.mlp.replay_layer = int(layer.layer_number) - 1  # megatron's layer_number: global, from 1
                count += 1
    return count
