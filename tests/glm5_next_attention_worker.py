"""Shared pieces of tests/test_glm5_next_attention.py and its spawned ranks: the tiny DSA config, transformers'
layers on random weights, ours built from them (this TP rank's shards, through dsa_weight_maps), and one rank's
forward/backward of a full and a shared DSA layer under TP (sequence parallel) and CP, float64."""

from __future__ import annotations

import torch

F64 = torch.float64
TEXT = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=0, v_head_dim=6, index_n_heads=2, index_head_dim=8, index_topk=8,
            index_kpool=4, index_kpool_always_select_tail=True, num_hidden_layers=4, vocab_size=64, pad_token_id=0,
            intermediate_size=40, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
            linear_num_heads=2, linear_head_dim=8, rms_norm_eps=1e-5,
            layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
            indexer_types=["full", "full", "shared", "full"], mlp_layer_types=["dense"] * 4)
FULL, SHARED = 1, 2  # the DSA layers of TEXT
PARALLEL_LENGTHS = [24, 16]  # multiples of 2 * CP, longer than index_topk + index_kpool - 1 (keys dropped)


def configs(**overrides):
    """(transformers' Glm5NextTextConfig with eager attention, our Glm5NextConfig) of TEXT | overrides."""
    from transformers import Glm5NextTextConfig

    from slime_plugins.models.glm5_next.config import from_hf

    text = TEXT | overrides
    hf = Glm5NextTextConfig(**text)
    hf._attn_implementation = "eager"
    return hf, from_hf(dict(text, model_type="glm5_next_text"))


def hf_attention(hf_config, layer: int, dtype, seed: int):
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention

    module = Glm5NextTextAttention(hf_config, layer).to(dtype).train()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():  # away from init: norms not 1, non-uniform attention, gated pools
            norm = name.endswith(("layernorm.weight", "k_norm.weight"))
            p.copy_((1.0 if norm else 0.0) + (0.1 if norm else 0.4) * torch.randn(p.shape, generator=g, dtype=F64))
    return module


def ours_from(hf_module, arch, layer: int, dtype, tp_rank: int = 0, tp: int = 1, **config_overrides):
    """Our layer (megatron's parallel state already initialised) holding this TP rank's shards of hf_module's weights."""
    from slime_plugins.models.glm5_next.attention import NopeMlaDsaAttention, dsa_weight_maps

    module = NopeMlaDsaAttention(arch.transformer_config(tp=tp, dtype=dtype, **config_overrides), layer + 1, arch)
    ours, theirs = dict(module.named_parameters()), dict(hf_module.named_parameters())
    maps = dsa_weight_maps(arch, layer, "a", "h")
    assert sorted(m.param[2:] for m in maps) == sorted(ours) and sorted(m.hf[0][2:] for m in maps) == sorted(theirs)
    with torch.no_grad():
        for m in maps:
            ours[m.param[2:]].copy_(m.to_local([theirs[m.hf[0][2:]]], tp_rank, tp))
    return module.train()


def parallel_inputs(arch):
    g = torch.Generator().manual_seed(11)
    total = sum(PARALLEL_LENGTHS)
    x = torch.randn(total, arch.hidden_size, generator=g, dtype=F64)
    return x, [torch.randn(total, arch.hidden_size, generator=g, dtype=F64) for _ in (FULL, SHARED)]


def rank_step(tp: int, cp: int) -> dict:
    """This rank's part of a forward/backward of the full and the shared layer on PARALLEL_LENGTHS: its output rows
    and input-grad rows (global row numbers) and its parameter grads (megatron names per layer)."""
    from megatron.core import parallel_state as ps

    from slime_plugins.models.common.context_parallel import build_layout
    from slime_plugins.models.common.rope import ForwardContext

    hf_config, arch = configs()
    tp_rank, cp_rank = ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank()
    layers = [ours_from(hf_attention(hf_config, layer, F64, layer), arch, layer, F64, tp_rank, tp)
              for layer in (FULL, SHARED)]
    x, weights = parallel_inputs(arch)
    cu = torch.tensor([0, *torch.tensor(PARALLEL_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    layout = build_layout(cu, cp, cp_rank, group=ps.get_context_parallel_group()) if cp > 1 else None
    rows = layout.local_index if layout is not None else torch.arange(x.shape[0])
    seg = layout.cu_seqlens_q if layout is not None else cu
    ctx = ForwardContext(qkv_format="thd", cu_seqlens_q=seg, cu_seqlens_kv=seg, cu_seqlens=seg, batch=1,
                         seq_len=rows.numel(), cp=layout)
    rows = rows.chunk(tp)[tp_rank]  # sequence parallel: this TP rank's slice of the local tokens
    local = x[rows].unsqueeze(1).requires_grad_(True)
    outs = [m(local, packed_seq_params=ctx)[0][:, 0] for m in layers]
    sum((o * w[rows]).sum() for o, w in zip(outs, weights)).backward()
    grads = {f"{i}.{n}": p.grad.clone() for i, m in enumerate(layers) for n, p in m.named_parameters()
             if p.requires_grad}
    return dict(rows=rows, outs=[o.detach() for o in outs], x_grad=local.grad[:, 0].clone(), grads=grads,
                tp_rank=tp_rank, cp_rank=cp_rank)


def run(rank: int, world: int, port: int, tp: int, cp: int, out_dir: str) -> None:
    from glm5_helpers import init_rank

    from slime.backends.megatron.parallel import init_parallel

    init_rank(rank, world, port)
    init_parallel(tp=tp, cp=cp)
    torch.save(rank_step(tp, cp), f"{out_dir}/rank{rank}.pt")
