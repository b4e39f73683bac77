"""torch_dist tensor names as upstream slime's GPU runs write them, and this project's earlier names.

Upstream builds Megatron-core's GPTModel with the Transformer-Engine layer spec; its sharded keys are
Megatron's (the local spec's `sharded_state_dict_keys_map` maps to the same names):
- `embedding.word_embeddings.weight`, `output_layer.weight` padded to a multiple of
  make_vocab_size_divisible_by x TP rows (the padding rows are zero here and ignored on load);
- GQA: `self_attention.linear_qkv.weight|bias` (per query group: its query heads, then its key and value
  head), `...linear_qkv.layer_norm_weight` (the input norm, fused), `linear_proj`, `q_layernorm`/`k_layernorm`;
- MLA (GLM-5, upstream's slime_plugins/models/glm5): `input_layernorm`, `linear_q_down_proj`,
  `linear_q_up_proj(.layer_norm_weight)`, `linear_kv_down_proj`, `linear_kv_up_proj(.layer_norm_weight)`,
  `linear_proj`, and the DSA indexer as `wq_b`, `wk`, `k_norm`, `weights_proj` with each indexer head's
  rope features last (HF puts them first);
- dense MLP: `mlp.linear_fc1.layer_norm_weight` (the pre-MLP norm, fused), `mlp.linear_fc1|fc2.weight`;
  MoE: `pre_mlp_layernorm`, `mlp.router.weight|expert_bias`, `mlp.experts.experts.linear_fc1|fc2.weight`
  ([E, 2I, H] / [E, H, I], split on the expert axis: TEGroupedMLP's and SequentialMLP's shared form),
  `mlp.shared_experts.*`; MTP `mtp.layers.{d}.*` (the same names as here);
- layers: `decoder.layers.{i}.*` when the layers differ (an MoE model: upstream passes a `--moe-layer-freq`
  list), else one stacked tensor `decoder.layers.*` with a leading layer axis (Megatron's homogeneous form).
This project's model names its parameters after HF (q_proj, router_weight, experts.weight1, ...); its
checkpoints up to this change stored those names (`embedding.weight`, per-layer keys). `translate` turns a
sharded state dict of this model (model and optimizer entries) into upstream's keys in place, for a save
and for a load (whose loaded tensors `Translation.restore` puts back under the model's names).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import torch

UPSTREAM = "upstream (Megatron-core TE names)"
EARLIER = "earlier slime names"

EXTRA_STATE = "._extra_state"
_OPT_PREFIX = re.compile(r"^(optimizer\.state\.[^.]+\.)(.*)$")
_LAYER_KEY = re.compile(r"^(decoder\.layers\.(?:(\d+)\.)?|mtp\.layers\.(\d+)\.transformer_layer\.)(.+)$")

# Whole-name renames inside a layer (attention family independent unless noted), then module renames.
_MODULE_RENAMES = {"self_attention.o_proj.": "self_attention.linear_proj."}
_GQA_RENAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                "self_attention.q_norm.weight": "self_attention.q_layernorm.weight",
                "self_attention.k_norm.weight": "self_attention.k_layernorm.weight",
                # GLM-4's output norms: layer submodules upstream, inside attention / MLP here
                "self_attention.post_self_attn_layernorm.weight": "post_self_attn_layernorm.weight",
                "mlp.post_mlp_layernorm.weight": "post_mlp_layernorm.weight"}
_MLA_RENAMES = {"self_attention.q_a_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
                "self_attention.kv_a_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
                "self_attention.indexer.weights_proj.weight": "self_attention.weights_proj.weight"}
_MLA_MODULES = {"self_attention.q_proj.": "self_attention.linear_q_proj.",
                "self_attention.q_a_proj.": "self_attention.linear_q_down_proj.",
                "self_attention.q_b_proj.": "self_attention.linear_q_up_proj.",
                "self_attention.kv_a_proj_with_mqa.": "self_attention.linear_kv_down_proj.",
                "self_attention.kv_b_proj.": "self_attention.linear_kv_up_proj."}
_INDEXER_PERMUTED = {"self_attention.indexer.wq_b.weight": "self_attention.wq_b.weight",
                     "self_attention.indexer.wk.weight": "self_attention.wk.weight",
                     "self_attention.indexer.k_norm.weight": "self_attention.k_norm.weight",
                     "self_attention.indexer.k_norm.bias": "self_attention.k_norm.bias"}
_MOE_RENAMES = {"mlp.router_weight": "mlp.router.weight", "mlp.expert_bias": "mlp.router.expert_bias"}
_EXPERTS = {"mlp.experts.weight1": "mlp.experts.experts.linear_fc1.weight",
            "mlp.experts.weight2": "mlp.experts.experts.linear_fc2.weight"}
_QKV = re.compile(r"^self_attention\.([qkv])_proj\.(weight|bias)$")
_VOCAB = {"embedding.weight": "embedding.word_embeddings.weight", "output_layer.weight": "output_layer.weight"}


def is_mla(arch) -> bool:
    return hasattr(arch, "kv_lora_rank")


def stacked_layers(arch) -> bool:
    """Upstream's layer form for this architecture: one stacked tensor per name when every layer is alike
    (the dense families), else per-layer keys (MoE models, GLM-5, the hybrid Qwen models whose layers alternate
    Gated DeltaNet and attention)."""
    return all(arch.mlp_type(i) == "dense" for i in range(arch.num_hidden_layers)) and not getattr(
        arch, "mtp_num_layers", 0) and len(set(getattr(arch, "layer_types", ()))) <= 1


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron's padded vocabulary: the next multiple of make_vocab_size_divisible_by x TP."""
    multiple = max(1, divisible_by) * tp
    return -(-vocab_size // multiple) * multiple


def has_stacked_layers(keys) -> bool:
    """Whether a checkpoint's tensor keys hold Megatron's stacked layers (`decoder.layers.<name>`, no index)."""
    return any(k.startswith("decoder.layers.") and not k.split(".")[2].isdigit() for k in keys)


def detect_layout(keys) -> str:
    """UPSTREAM or EARLIER from a checkpoint's tensor keys (load_tensors_metadata)."""
    keys = set(keys)
    if "embedding.weight" in keys or any(k.startswith("decoder.layers.") and ".self_attention.o_proj." in k for k in keys):
        return EARLIER
    return UPSTREAM


def upstream_name(arch, key: str) -> str | None:
    """The upstream key of a model key that only changes its name (None: not a pure rename)."""
    if key in _VOCAB:
        return None
    m = _LAYER_KEY.match(key)
    if not m:
        return key
    prefix, index, mtp, rest = m.groups()
    layer = int(index) if index is not None else (arch.num_hidden_layers + int(mtp) if mtp is not None else 0)
    renames = dict(_MLA_RENAMES if is_mla(arch) else _GQA_RENAMES)
    if getattr(arch, "full_width_qk_norm", False):  # upstream's own q_norm / k_norm modules (MiniMax-M2's spec)
        renames = {k: v for k, v in renames.items() if not k.startswith(("self_attention.q_norm", "self_attention.k_norm"))}
    linear = layer < arch.num_hidden_layers and bool(getattr(arch, "layer_types", None)) and arch.is_linear(layer)
    if linear:
        # upstream's Gated DeltaNet layers (slime_plugins/models/qwen3_next.py there) hold their input norm
        renames["input_layernorm.weight"] = "self_attention.input_layernorm.weight"
    if arch.mlp_type(layer) == "dense":
        renames["pre_mlp_layernorm.weight"] = "mlp.linear_fc1.layer_norm_weight"
    else:
        renames.update(_MOE_RENAMES)
    if rest in renames:
        return prefix + renames[rest]
    # q/k/v rows fuse into attention's linear_qkv; a linear-attention layer's own q/k/v projections (GLM-5.3-Flash's
    # KDA) keep their names
    if rest in _INDEXER_PERMUTED or rest in _EXPERTS or (_QKV.match(rest) and not linear):
        return None
    for old, new in {**_MODULE_RENAMES, **(_MLA_MODULES if is_mla(arch) else {})}.items():
        if rest.startswith(old):
            return prefix + new + rest[len(old):]
    return key


@dataclasses.dataclass
class Translation:
    """What `translate` moved out of the state dict: state[SLOT][i] replaced the entries at `paths[i]`;
    `inverse[i]` turns the loaded tensor back into theirs."""

    paths: list[list[tuple]] = dataclasses.field(default_factory=list)
    inverse: list[Callable[[torch.Tensor], list[torch.Tensor]]] = dataclasses.field(default_factory=list)
    dropped: list[tuple] = dataclasses.field(default_factory=list)  # extra states not requested (load)

    def restore(self, loaded: dict) -> None:
        moved = loaded.pop(SLOT, {})
        for i, (paths, inverse) in enumerate(zip(self.paths, self.inverse)):
            for path, tensor in zip(paths, inverse(moved[str(i)])):
                _set(loaded, path, tensor)
        for path in self.dropped:
            _set(loaded, path, None)


SLOT = "upstream_layout"


def _leaves(node, path=()):
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    if isinstance(node, ShardedBase):
        yield path, node
    elif isinstance(node, dict):
        for k, v in list(node.items()):
            yield from _leaves(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, (*path, i))


def _set(root, path, value) -> None:
    node = root
    for k in path[:-1]:
        node = node.setdefault(k, {}) if isinstance(node, dict) else node[k]  # a load drops emptied containers
    node[path[-1]] = value


def _pop(root, path) -> None:
    """Remove the entry at `path`, and the dicts below the top level that this leaves empty (e.g. a parameter's
    optimizer state once its param / exp_avg / exp_avg_sq have moved): an empty container left in a sharded
    state dict is a non-tensor value, kept in the checkpoint's common state and compared across ranks by
    dist_checkpointing, and only the ranks that write the moved tensors would hold it."""
    nodes = [root]
    for k in path[:-1]:
        nodes.append(nodes[-1][k])
    if not isinstance(nodes[-1], dict):
        nodes[-1][path[-1]] = None  # keep list positions
        return
    del nodes[-1][path[-1]]
    for depth in range(len(path) - 1, 1, -1):  # state["model"] / state["optimizer"] themselves stay
        parent, node = nodes[depth - 1], nodes[depth]
        if node or not isinstance(parent, dict):
            break
        del parent[path[depth - 1]]


def _reshaped(sh, key: str, data: torch.Tensor, axis_order: tuple[int, ...] | None = None, rows: int | None = None):
    """A ShardedTensor like `sh` under `key` holding `data`: the data axes permuted by axis_order, or its
    first data axis resized to `rows` local rows (same fragmentation)."""
    p = sh.prepend_axis_num
    gshape, goff, frag = list(sh.global_shape), list(sh.global_offset), list(sh.axis_fragmentations)
    if axis_order is not None:
        order = list(range(p)) + [p + a for a in axis_order]
        gshape, goff, frag = [gshape[a] for a in order], [goff[a] for a in order], [frag[a] for a in order]
    if rows is not None:
        chunk = goff[p] // sh.local_shape[0]
        gshape[p], goff[p] = rows * frag[p], chunk * rows
    return dataclasses.replace(sh, key=key, data=data, dtype=data.dtype, local_shape=tuple(data.shape),
                               global_shape=tuple(gshape), global_offset=tuple(goff), axis_fragmentations=tuple(frag))


def _whole(sh, key: str, data: torch.Tensor, tp_rank: int):
    """A ShardedTensor of the whole (unsharded) `data`, written by TP rank 0 of sh's writers."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    rid = sh.replica_id
    rid = (rid[0], tp_rank, *rid[2:]) if isinstance(rid, tuple) else (rid, tp_rank)
    return ShardedTensor.from_rank_offsets(key, data, replica_id=rid)


def _indexer_perm(arch, rest: str, n: int) -> torch.Tensor:
    """Row order of upstream's indexer tensor from HF's (per head: rope features moved after the rest)."""
    d, r = arch.index_head_dim, arch.qk_rope_head_dim
    head = torch.cat([torch.arange(r, d), torch.arange(r)])
    heads = n // d
    return (head[None, :] + d * torch.arange(heads)[:, None]).reshape(-1)


def _translate_extra_state(state: dict, tr: Translation, arch, path, sh, opt: str, key: str, loading: bool) -> None:
    """A linear layer's extra state (a ShardedObject): dropped when loading (Megatron's linear layers ignore it),
    else renamed to upstream's key (one for the fused q/k/v projection, under linear_qkv)."""
    if loading:
        _pop(state, path)
        tr.dropped.append(path)
        return
    base = upstream_name(arch, key[: -len(EXTRA_STATE)] + ".weight")
    lm = _LAYER_KEY.match(key)
    if lm and _QKV.match(lm.group(4)[: -len(EXTRA_STATE)] + ".weight"):
        if lm.group(4).startswith("self_attention.q_proj"):
            sh.key = opt + lm.group(1) + "self_attention.linear_qkv" + EXTRA_STATE
        else:
            _pop(state, path)  # one extra state for the fused projection
        return
    if base is not None:
        sh.key = opt + base[: -len(".weight")] + EXTRA_STATE


def _vocab_padded(sh, opt: str, key: str, tp_rank: int, loading: bool, saved_shapes: dict[str, tuple] | None,
                  vocab_divisible_by: int):
    """An embedding or output layer as upstream saves it: whole, with Megatron's vocab padding (loading: a
    buffer of the checkpoint's padded size). Returns (the ShardedTensor, its inverse to this rank's rows)."""
    from megatron.core import parallel_state as ps

    frag = sh.axis_fragmentations[0]
    chunk = sh.global_offset[0] // sh.local_shape[0]
    vocab = sh.global_shape[0]
    if loading:
        padded = (saved_shapes or {}).get(_VOCAB[key], (vocab,))[0]
        full = torch.empty(padded, *sh.local_shape[1:], dtype=sh.dtype, device=sh.data.device)
    else:
        from slime.backends.megatron.hf_export import gather_shards

        full = torch.cat(gather_shards(sh.data, ps.get_tensor_model_parallel_group() if frag > 1 else None))
        pad = padded_vocab_size(vocab, vocab_divisible_by, frag) - vocab
        full = torch.cat([full, full.new_zeros(pad, *full.shape[1:])]) if pad else full
    return _whole(sh, opt + _VOCAB[key], full, tp_rank), lambda t, v=vocab, f=frag, c=chunk: [t[:v].chunk(f)[c]]


def translate(state: dict, arch, *, loading: bool, saved_shapes: dict[str, tuple] | None = None,
              vocab_divisible_by: int = 128) -> Translation:
    """Give the ShardedTensors of `state` (its "model" and "optimizer" entries) upstream's keys, in place.
    Pure renames change the key; fused, transposed, permuted and vocab-padded tensors are moved to
    state[SLOT]. loading: their data is only a buffer of the right shape, the extra states are not requested
    (Megatron's linear layers ignore them) and `saved_shapes` gives the checkpoint's padded vocab."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    tr = Translation()
    moved: dict[str, Any] = {}
    qkv: dict[tuple, dict[str, tuple]] = {}
    tp_rank = ps.get_tensor_model_parallel_rank()

    def move(paths, sharded, inverse):
        moved[str(len(tr.paths))] = sharded
        tr.paths.append(paths)
        tr.inverse.append(inverse)
        for path in paths:
            _pop(state, path)

    for path, sh in list(_leaves({k: state[k] for k in ("model", "optimizer") if k in state})):
        m = _OPT_PREFIX.match(sh.key)
        opt, key = (m.group(1), m.group(2)) if m else ("", sh.key)
        if key.endswith(EXTRA_STATE) and isinstance(sh, ShardedObject):
            _translate_extra_state(state, tr, arch, path, sh, opt, key, loading)
            continue
        new = upstream_name(arch, key)
        if new is not None:
            sh.key = opt + new
            continue
        if not isinstance(sh, ShardedTensor) or sh.flattened_range is not None:
            raise ValueError(f"cannot translate {sh.key!r} to upstream's layout ({type(sh).__name__})")
        if key in _VOCAB:
            move([path], *_vocab_padded(sh, opt, key, tp_rank, loading, saved_shapes, vocab_divisible_by))
            continue
        lm = _LAYER_KEY.match(key)
        prefix, rest = lm.group(1), lm.group(4)
        if rest in _EXPERTS:
            data = sh.data.transpose(1, 2).contiguous()
            move([path], _reshaped(sh, opt + prefix + _EXPERTS[rest], data, axis_order=(0, 2, 1)),
                 lambda t: [t.transpose(1, 2)])
        elif rest in _INDEXER_PERMUTED:
            perm = _indexer_perm(arch, rest, sh.local_shape[0]).to(sh.data.device)
            inv = torch.argsort(perm)
            move([path], _reshaped(sh, opt + prefix + _INDEXER_PERMUTED[rest], sh.data[perm]),
                 lambda t, i=inv: [t[i]])
        else:  # q / k / v: fused once all three are seen
            which, kind = _QKV.match(rest).groups()
            group = qkv.setdefault((opt, prefix, kind, sh.global_offset[:sh.prepend_axis_num]), {})
            group[which] = (path, sh)
            if len(group) == 3:
                _fuse_qkv(arch, group, opt + prefix + f"self_attention.linear_qkv.{kind}", move)
    leftover = [g for g in qkv.values() if len(g) != 3]
    if leftover:
        raise ValueError(f"q/k/v projections without their partners: {sorted(sh.key for g in leftover for _, sh in g.values())}")
    state[SLOT] = moved
    return tr


def _fuse_qkv(arch, group: dict, key: str, move) -> None:
    """Megatron's linear_qkv rows of this TP rank: per local query group, its query heads, key, value."""
    (pq, q), (pk, k), (pv, v) = group["q"], group["k"], group["v"]
    d = arch.head_dim
    groups = k.local_shape[0] // d
    per = q.local_shape[0] // (groups * d)
    tail = q.data.shape[1:]
    # Output-gated attention (Qwen3-Next / Qwen3.5): HF's q_proj rows are [query; gate] per head, Megatron's
    # linear_qkv holds a group's queries, then its gates (per = 2 x the group's query heads)
    gated = bool(getattr(arch, "attention_output_gate", False))
    queries = q.data.reshape(groups, per // 2, 2, d, *tail).transpose(1, 2) if gated else q.data
    fused = torch.cat([queries.reshape(groups, per * d, *tail), k.data.reshape(groups, d, *tail),
                       v.data.reshape(groups, d, *tail)], dim=1).reshape(-1, *tail)

    def split(t, g=groups, per=per, d=d):
        t = t.reshape(g, (per + 2) * d, *t.shape[1:])
        qs, ks, vs = t.split([per * d, d, d], dim=1)
        if gated:
            qs = qs.reshape(g, 2, per // 2, d, *t.shape[2:]).transpose(1, 2)
        return [x.reshape(-1, *t.shape[2:]) for x in (qs, ks, vs)]

    move([pq, pk, pv], _reshaped(q, key, fused, rows=fused.shape[0]), split)


def megatron_args(arch, layout: dict[str, int], vocab_divisible_by: int = 128):
    """The Megatron argument names upstream's tools read from a checkpoint's common.pt `args`."""
    import argparse

    tp = int(layout.get("tp", 1))
    mla = is_mla(arch)
    return argparse.Namespace(
        num_layers=arch.num_hidden_layers, hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=getattr(arch, "num_key_value_heads", arch.num_attention_heads),
        kv_channels=None if mla else arch.head_dim, group_query_attention=not mla,
        num_experts=getattr(arch, "n_routed_experts", None) or None,
        vocab_size=arch.vocab_size, padded_vocab_size=padded_vocab_size(arch.vocab_size, vocab_divisible_by, tp),
        make_vocab_size_divisible_by=vocab_divisible_by,
        untie_embeddings_and_output_weights=not arch.tie_word_embeddings,
        q_lora_rank=getattr(arch, "q_lora_rank", None), kv_lora_rank=getattr(arch, "kv_lora_rank", None),
        multi_latent_attention=mla, mtp_num_layers=getattr(arch, "mtp_num_layers", 0) or None,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=int(layout.get("pp", 1)),
        expert_model_parallel_size=int(layout.get("ep", 1)), ckpt_format="torch_dist", no_save_rng=False,
        no_save_optim=False)


def upstream_key(arch, key: str) -> str:
    """The upstream key a model key is stored under (q / k / v projections: their fused linear_qkv)."""
    if key in _VOCAB:
        return _VOCAB[key]
    renamed = upstream_name(arch, key)
    if renamed is not None:
        return renamed
    prefix, rest = _LAYER_KEY.match(key).group(1, 4)
    if rest in _EXPERTS:
        return prefix + _EXPERTS[rest]
    if rest in _INDEXER_PERMUTED:
        return prefix + _INDEXER_PERMUTED[rest]
    return prefix + f"self_attention.linear_qkv.{_QKV.match(rest).group(2)}"


def model_keys(arch) -> list[str]:
    """This project's names of every tensor the whole model (no MTP) loads, from the family's weight maps
    (its `layer_maps` beside its `weight_maps`): the earlier checkpoint layout's keys."""
    import importlib

    from slime_plugins.models.common.weights import model_maps
    from slime_plugins.models.registry import get_family

    layer_maps = importlib.import_module(get_family(arch.model_type).weight_maps.partition(":")[0]).layer_maps
    maps = model_maps(arch, layer_maps, 0, arch.num_hidden_layers, True, True, 0, 1)
    return list(dict.fromkeys(m.param for m in maps))


def expected_keys(arch, layout: str, stacked: bool) -> set[str]:
    """The tensor keys a checkpoint in `layout` (UPSTREAM / EARLIER) holds for this model's weights."""
    keys = model_keys(arch)
    if layout == UPSTREAM:
        keys = [upstream_key(arch, k) for k in keys]
    if stacked:
        keys = [re.sub(r"^decoder\.layers\.\d+\.", "decoder.layers.", k) for k in keys]
    return set(keys)
