"""HF checkpoint names <-> a model's parameters, with the TP / EP sharding of each (shared by every family).

One `WeightMap` per megatron parameter (or persistent buffer) of this rank: the HF tensors it is made of
and the sharding rule. The loader turns full HF tensors into this rank's shard (`to_local`); the exporter
gathers shards and turns them back into full HF tensors (`to_hf`). HF names are the transformers 5.x
per-expert layout (`mlp.experts.{e}.gate_proj.weight`); fused `gate_up_proj` checkpoints are read too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


# Sharding kinds
REPLICATED = "replicated"
TP_ROWS = "tp_rows"  # split on dim 0 over TP (column-parallel weights, vocab-parallel tables)
TP_COLS = "tp_cols"  # split on dim 1 over TP (row-parallel weights)
TP_GATE_UP = "tp_gate_up"  # [gate; up] rows, each split over TP, the rank's halves concatenated
TP_GATE_UP_FUSED = "tp_gate_up_fused"  # as TP_GATE_UP from one HF tensor [gate; up] (GLM-4's mlp.gate_up_proj)
REPLICATED_HALVES_SWAPPED = "replicated_halves_swapped"  # whole; HF's [a | b] columns held as [b | a] (MiMo's MTP input_proj)
EXPERT_W1 = "expert_w1"  # [E_local, H, 2I] from per-expert gate/up [I, H]
EXPERT_W2 = "expert_w2"  # [E_local, I, H] from per-expert down [H, I]


@dataclass(frozen=True)
class WeightMap:
    param: str  # megatron name in model.state_dict()
    hf: tuple[str, ...]  # HF names, in the order the rule uses them
    kind: str
    experts: tuple[int, ...] = ()  # global expert ids of the local shard (EXPERT_*)
    expert_prefix: str = ""  # "model.layers.L.mlp.experts" (EXPERT_*)
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per-expert HF names (Mixtral: w1 w3 w2)

    def hf_names_after_gather(self, num_experts: int) -> tuple[str, ...]:
        """HF names of `to_hf` of the gathered shards: for expert weights, every expert's."""
        p, (gate, up, down) = self.expert_prefix, self.expert_names
        if self.kind == EXPERT_W1:
            return tuple(n for e in range(num_experts) for n in (f"{p}.{e}.{gate}.weight", f"{p}.{e}.{up}.weight"))
        if self.kind == EXPERT_W2:
            return tuple(f"{p}.{e}.{down}.weight" for e in range(num_experts))
        return self.hf

    def to_local(self, full: list[torch.Tensor], tp_rank: int, tp: int) -> torch.Tensor:
        if self.kind == REPLICATED:
            return full[0]
        if self.kind == REPLICATED_HALVES_SWAPPED:
            return _swap_column_halves(full[0])
        if self.kind == TP_ROWS:
            return full[0].chunk(tp, dim=0)[tp_rank]
        if self.kind == TP_COLS:
            return full[0].chunk(tp, dim=1)[tp_rank]
        if self.kind in (TP_GATE_UP, TP_GATE_UP_FUSED):
            gate, up = full if self.kind == TP_GATE_UP else full[0].chunk(2, dim=0)
            return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
        if self.kind == EXPERT_W1:  # hf = (gate_e0, up_e0, gate_e1, up_e1, ...)
            return torch.stack([torch.cat([g.t(), u.t()], dim=1) for g, u in zip(full[0::2], full[1::2])])
        if self.kind == EXPERT_W2:
            return torch.stack([d.t() for d in full])
        raise ValueError(self.kind)

    def to_hf(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """Full HF tensors from the shards of every TP rank (TP kinds) / every EP rank (EXPERT kinds,
        concatenated in expert order) / the one local tensor (REPLICATED). Nothing is copied that need not
        be: with one shard the results are views of it (expert weights transposed, not contiguous), so a
        weight sync copies each byte once, into its own buffer. Copy them before the shard changes."""
        def cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

        if self.kind == REPLICATED:
            return [shards[0]]
        if self.kind == REPLICATED_HALVES_SWAPPED:
            return [_swap_column_halves(shards[0])]
        if self.kind == TP_ROWS:
            return [cat(shards, 0)]
        if self.kind == TP_COLS:
            return [cat(shards, 1)]
        if self.kind in (TP_GATE_UP, TP_GATE_UP_FUSED):
            halves = [s.chunk(2, dim=0) for s in shards]
            gate, up = cat([h[0] for h in halves], 0), cat([h[1] for h in halves], 0)
            if self.kind == TP_GATE_UP:
                return [gate, up]
            return [shards[0] if len(shards) == 1 else torch.cat([gate, up], dim=0)]  # one shard: already [gate; up]
        experts = cat(shards, 0)
        if self.kind == EXPERT_W1:
            ffn = experts.shape[2] // 2
            out = []
            for w in experts:
                out += [w[:, :ffn].t(), w[:, ffn:].t()]
            return out
        if self.kind == EXPERT_W2:
            return [w.t() for w in experts]
        raise ValueError(self.kind)


def _swap_column_halves(t: torch.Tensor) -> torch.Tensor:
    first, second = t.chunk(2, dim=1)
    return torch.cat([second, first], dim=1)


def mlp_maps(arch, layer: int, prefix: str, hf_prefix: str, ep_rank: int, ep: int) -> list[WeightMap]:
    """Maps of one decoder layer's norms and MLP (dense SwiGLU or MoE): megatron names under `prefix`,
    HF names under `hf_prefix`. The family adds its attention's maps."""
    maps = [
        WeightMap(f"{prefix}.input_layernorm.weight", (f"{hf_prefix}.input_layernorm.weight",), REPLICATED),
        WeightMap(f"{prefix}.pre_mlp_layernorm.weight", (f"{hf_prefix}.post_attention_layernorm.weight",), REPLICATED),
    ]
    m, hm = f"{prefix}.mlp", f"{hf_prefix}.mlp"
    if arch.mlp_type(layer) == "dense":
        maps += [WeightMap(f"{m}.linear_fc1.weight", (f"{hm}.gate_proj.weight", f"{hm}.up_proj.weight"), TP_GATE_UP),
                 WeightMap(f"{m}.linear_fc2.weight", (f"{hm}.down_proj.weight",), TP_COLS)]
        return maps
    per_rank = arch.n_routed_experts // ep
    local = tuple(range(ep_rank * per_rank, (ep_rank + 1) * per_rank))
    maps.append(WeightMap(f"{m}.router_weight", (f"{hm}.gate.weight",), REPLICATED))
    if arch.router == "sigmoid":
        maps.append(WeightMap(f"{m}.expert_bias", (f"{hm}.gate.e_score_correction_bias",), REPLICATED))
    maps += [
        WeightMap(f"{m}.experts.weight1",
                  tuple(n for e in local for n in (f"{hm}.experts.{e}.gate_proj.weight", f"{hm}.experts.{e}.up_proj.weight")),
                  EXPERT_W1, local, f"{hm}.experts"),
        WeightMap(f"{m}.experts.weight2", tuple(f"{hm}.experts.{e}.down_proj.weight" for e in local), EXPERT_W2, local,
                  f"{hm}.experts"),
    ]
    if arch.n_shared_experts:
        s, hs = f"{m}.shared_experts", f"{hm}.shared_experts"
        maps += [WeightMap(f"{s}.linear_fc1.weight", (f"{hs}.gate_proj.weight", f"{hs}.up_proj.weight"), TP_GATE_UP),
                 WeightMap(f"{s}.linear_fc2.weight", (f"{hs}.down_proj.weight",), TP_COLS)]
    return maps


def model_maps(arch, layer_maps, layer_offset: int, num_local_layers: int, pre_process: bool, post_process: bool,
               ep_rank: int = 0, ep: int = 1) -> list[WeightMap]:
    """Maps of every parameter of one pipeline stage (layers offset .. offset + n - 1);
    layer_maps(arch, layer, prefix, hf_prefix, ep_rank, ep) gives one decoder layer's. A tied output layer
    is the embedding table itself (no lm_head.weight in the checkpoint)."""
    maps = []
    if pre_process:
        maps.append(WeightMap("embedding.weight", ("model.embed_tokens.weight",), TP_ROWS))
    for i in range(num_local_layers):
        layer = layer_offset + i
        maps += layer_maps(arch, layer, f"decoder.layers.{i}", f"model.layers.{layer}", ep_rank, ep)
    if post_process:
        maps.append(WeightMap("decoder.final_layernorm.weight", ("model.norm.weight",), REPLICATED))
        if not arch.tie_word_embeddings:
            maps.append(WeightMap("output_layer.weight", ("lm_head.weight",), TP_ROWS))
    return maps


def all_hf_names(arch, layer_maps) -> list[str]:
    """Every HF tensor name of the whole model (all stages, all experts), in export order."""
    maps = model_maps(arch, layer_maps, 0, arch.num_hidden_layers, True, True, 0, 1)
    return [n for m in maps for n in m.hf]


def is_mtp_name(arch, name: str) -> bool:
    """MTP layers are stored as extra layers after the last decoder layer (model.layers.{N + i}.*); a family
    whose checkpoints keep other untrained tensors (Qwen3-Next's `mtp.*`, Qwen3.5's vision tower) lists their
    prefixes in `arch.kept_hf_prefixes`. Such tensors are written back unchanged."""
    if name.startswith(tuple(getattr(arch, "kept_hf_prefixes", ()))):
        return True
    if not name.startswith("model.layers."):
        return False
    index = name.split(".")[2]
    return index.isdigit() and int(index) >= arch.num_hidden_layers


def is_mtp_layer_name(arch, name: str) -> bool:
    """A tensor of an MTP layer itself: a kept tensor (is_mtp_name) outside the vision tower that a family names
    in `arch.vision_hf_prefixes` (GLM-5.3-Flash keeps both; the vision tower is never trained)."""
    return is_mtp_name(arch, name) and not name.startswith(tuple(getattr(arch, "vision_hf_prefixes", ())))


def stage_of(model) -> tuple[int, int, bool, bool, int, int]:
    """(layer offset, local layers, pre_process, post_process, ep rank, ep) of this rank's model shard."""
    from megatron.core import parallel_state as ps

    layers = model.decoder.layers
    offset = layers[0].layer_number - 1 if len(layers) else 0
    ep_rank, ep = ps.get_expert_model_parallel_rank(), model.config.expert_model_parallel_size
    return offset, len(layers), model.pre_process, model.post_process, ep_rank, ep
