"""MoE layer: a router (`arch.router`: "sigmoid" = GLM/DeepSeek sigmoid scores with expert bias and
group-limited top-k through `ops.moe_route`; "softmax" = Qwen-MoE softmax top-k), routed experts as grouped
SwiGLU matmuls (`ops.moe_permute` / `grouped_matmul` / `swiglu` / `moe_unpermute`), plus the optional
shared expert.

Parallelism: expert tensor parallel is 1. Each EP rank holds n_routed_experts / ep experts; tokens go to
the ranks of their experts with an all-to-all over the expert-parallel group and come back the same way.
With TP the layer works on the rank's own (sequence-parallel) tokens; router and expert grads are then
partial per TP rank and summed by megatron (router weight marked `sequence_parallel`; experts marked
`allreduce=False`, reduced over the expert-data-parallel group, which includes the TP ranks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule

from slime.accelerator import get_accelerator
from slime_plugins.models.common.layers import KeepsFloat32, SwiGLUMLP, clamp_gate_up


class GroupedExperts(torch.nn.Module):
    """This EP rank's experts: weight1 [E_local, H, 2I] ([gate | up] columns), weight2 [E_local, I, H];
    `swiglu_limit` as SwiGLUMLP's."""

    swiglu_limit: float | None = None

    def __init__(self, num_local: int, hidden: int, ffn: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight1 = torch.nn.Parameter(torch.empty(num_local, hidden, 2 * ffn, dtype=dtype))
        self.weight2 = torch.nn.Parameter(torch.empty(num_local, ffn, hidden, dtype=dtype))
        for w in (self.weight1, self.weight2):
            torch.nn.init.normal_(w, std=0.02)
            w.allreduce = False  # megatron DDP: expert parameter, reduced over the expert-data-parallel group
        # Shards of the expert-tensor-parallel group (size 1), marked as megatron marks its own expert
        # weights: the expert optimizer then counts them on every TP rank and reduces the grad norm over
        # the expert tensor-model-pipeline group (TP ranks excluded). Unmarked, only TP rank 0 would count them.
        tensor_parallel.set_tensor_model_parallel_attributes(self.weight1, is_parallel=True, dim=2, stride=2)
        tensor_parallel.set_tensor_model_parallel_attributes(self.weight2, is_parallel=True, dim=1, stride=1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Checkpoint view: each weight is one [E, ...] tensor split on the expert axis over EP (this rank's
        experts at offset ep_rank * E_local), whole on every rank of the expert-data-parallel group (TP ranks
        included, as expert TP is 1), whose rank 0 writes it."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        ep_rank, ep = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
        replica_id = (0, 0, ps.get_expert_data_parallel_rank())
        axis = len(sharded_offsets)
        return {f"{prefix}{name}": ShardedTensor.from_rank_offsets(f"{prefix}{name}", p, *sharded_offsets, (axis, ep_rank, ep),
                                                                   replica_id=replica_id, prepend_axis_num=axis)
                for name, p in self.named_parameters(recurse=False)}

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        ops = get_accelerator().ops
        h = ops.swiglu(clamp_gate_up(ops.grouped_matmul(x, self.weight1, tokens_per_expert), self.swiglu_limit))
        return ops.grouped_matmul(h, self.weight2, tokens_per_expert)


class MoELayer(KeepsFloat32, MegatronModule):
    """Reads from `arch`: n_routed_experts, num_experts_per_tok, moe_intermediate_size, n_shared_experts,
    hidden_size, router ("sigmoid" | "softmax"), norm_topk_prob; for "sigmoid" also n_group, topk_group,
    routed_scaling_factor (expert bias buffer `expert_bias`, not trained). The router weight stays float32
    when `arch.router_dtype_float32` (GLM, as transformers keeps it), else follows the model dtype (Qwen)."""

    bound_arch = None
    replay_layer: int | None = None  # global decoder layer index under routing replay (model.install_routing_replay)

    @classmethod
    def bound_to(cls, arch) -> type["MoELayer"]:
        """A subclass that knows its architecture (megatron's layer builder passes only `config`)."""
        return type(cls.__name__, (cls,), {"bound_arch": arch})

    def __init__(self, config, arch=None, **_: object) -> None:
        super().__init__(config=config)
        arch = arch or self.bound_arch
        self.arch = arch
        self.ep = config.expert_model_parallel_size
        self.num_local = arch.n_routed_experts // self.ep
        fp32 = arch.router_dtype_float32
        self.float32_names = (("router_weight",) if fp32 else ()) + (("expert_bias",) if arch.router == "sigmoid" else ())
        self.router_weight = torch.nn.Parameter(torch.empty(arch.n_routed_experts, arch.hidden_size,
                                                            dtype=torch.float32 if fp32 else config.params_dtype))
        torch.nn.init.normal_(self.router_weight, std=0.02)
        self.router_weight.sequence_parallel = config.sequence_parallel
        if arch.router == "sigmoid":
            self.register_buffer("expert_bias", torch.zeros(arch.n_routed_experts, dtype=torch.float32))  # not trained
        else:
            self.expert_bias = None
        self.experts = GroupedExperts(self.num_local, arch.hidden_size, arch.moe_intermediate_size, config.params_dtype)
        self.shared_experts = (
            SwiGLUMLP(config, ffn_hidden_size=arch.moe_intermediate_size * arch.n_shared_experts)
            if arch.n_shared_experts else None
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32 [T, k], expert ids [T, k]) in transformers' op order for the router kind. Under
        routing replay the ids are the replayed ones (where given) and the weights the router's at those ids."""
        from slime.utils.routing_replay import REPLAY

        arch = self.arch
        replayed = REPLAY.choice(self.replay_layer, x.shape[0], x.device)
        # --moe-router-dtype (Megatron's moe_router_dtype): the logits' precision; unset, transformers' op order
        wanted = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype)
        if arch.router == "softmax":  # Qwen3-MoE: logits in the model dtype, softmax in float32
            dtype = wanted or self.router_weight.dtype
            probs = torch.softmax(x.to(dtype) @ self.router_weight.to(dtype).t(), dim=-1, dtype=torch.float32)
            weights, indices = torch.topk(probs, arch.num_experts_per_tok, dim=-1)
            if replayed is not None:
                indices = torch.where(replayed[1][:, None], replayed[0], indices)
                weights = probs.gather(1, indices)
            if arch.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            REPLAY.record(self.replay_layer, indices)
            return weights, indices
        if wanted == torch.float64:
            logits = (x.double() @ self.router_weight.double().t()).float()
        else:
            logits = x.float() @ self.router_weight.float().t()
        if replayed is not None:
            return self._replayed_sigmoid_weights(logits, *replayed)
        weights, indices = get_accelerator().ops.moe_route(logits, self.expert_bias, arch.num_experts_per_tok, arch.n_group,
                                                           arch.topk_group, arch.routed_scaling_factor, arch.norm_topk_prob)
        REPLAY.record(self.replay_layer, indices)
        return weights, indices

    def _replayed_sigmoid_weights(self, logits: torch.Tensor, ids: torch.Tensor, replayed: torch.Tensor
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """moe_route's weights at given experts: unbiased sigmoid scores, / (sum + 1e-20) when norm_topk_prob,
        x routed_scaling_factor. Rows not replayed take the router's own choice."""
        arch = self.arch
        if not bool(replayed.all()):
            _, own = get_accelerator().ops.moe_route(logits.detach(), self.expert_bias, arch.num_experts_per_tok,
                                                     arch.n_group, arch.topk_group, arch.routed_scaling_factor,
                                                     arch.norm_topk_prob)
            ids = torch.where(replayed[:, None], ids, own.to(ids.dtype))
        weights = torch.sigmoid(logits).gather(1, ids)
        if arch.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * arch.routed_scaling_factor, ids

    def forward(self, hidden_states: torch.Tensor, padding_mask=None):
        ops = get_accelerator().ops
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        weights, indices = self.route(x)
        permuted, sort_map = ops.moe_permute(x, indices)
        counts = torch.bincount(indices.reshape(-1), minlength=self.arch.n_routed_experts)
        if self.ep == 1:
            out = self.experts(permuted, counts)
        else:
            out = self._expert_parallel(permuted, counts)
        routed = ops.moe_unpermute(out, sort_map, weights)
        routed = routed.view_as(hidden_states)
        if self.shared_experts is not None:
            shared, _ = self.shared_experts(hidden_states)
            routed = routed + shared
        return routed, None

    def _expert_parallel(self, permuted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """permuted rows are sorted by global expert id, so each EP rank's rows are contiguous."""
        ops = get_accelerator().ops
        group = ps.get_expert_model_parallel_group()
        send_counts = counts.view(self.ep, self.num_local)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=group)  # [source rank, local expert]
        input_splits = send_counts.sum(1).tolist()
        output_splits = recv_counts.sum(1).tolist()
        received = tensor_parallel.all_to_all(group, permuted, output_splits, input_splits)
        # Rows arrive grouped by (source rank, local expert): regroup by local expert for the matmuls.
        local_ids = torch.arange(self.num_local, device=counts.device).repeat(self.ep)
        local_ids = local_ids.repeat_interleave(recv_counts.reshape(-1))
        by_expert, regroup = ops.moe_permute(received, local_ids[:, None])
        out = self.experts(by_expert, recv_counts.sum(0))
        ones = torch.ones(received.shape[0], 1, dtype=torch.float32, device=received.device)
        out = ops.moe_unpermute(out, regroup, ones)
        return tensor_parallel.all_to_all(group, out, input_splits, output_splits)
