"""Shared pieces of tests/test_glm5_next_kda.py and its spawned ranks: a tiny KDA config, transformers' KDA layer
(Glm5NextTextLinearAttention) on random weights, its tensors under the checkpoint's on-disk names, ours built
from them (this TP rank's shards, through kda_weight_maps), and one rank's forward/backward under TP (sequence
parallel) and CP, float64."""

from __future__ import annotations

import torch

F64 = torch.float64
TEXT = dict(hidden_size=24, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=8, kv_lora_rank=8,
            qk_nope_head_dim=4, qk_rope_head_dim=0, v_head_dim=4, index_n_heads=2, index_head_dim=4, index_topk=4,
            index_kpool=2, num_hidden_layers=2, vocab_size=32, pad_token_id=0, intermediate_size=16,
            moe_intermediate_size=8, n_routed_experts=2, num_experts_per_tok=1, linear_num_heads=4,
            linear_head_dim=8, linear_conv_kernel_dim=4, rms_norm_eps=1e-5,
            layer_types=["linear_attention", "indexed_attention"], indexer_types=["full", "full"],
            mlp_layer_types=["dense"] * 2)
PARALLEL_LENGTHS = [72, 8]  # multiples of 2 * CP; the first spans two KDA chunks


def configs(**overrides):
    """(transformers' Glm5NextTextConfig, our Glm5NextConfig) of TEXT | overrides."""
    from transformers import Glm5NextTextConfig

    from slime_plugins.models.glm5_next.config import from_hf

    text = TEXT | overrides
    return Glm5NextTextConfig(**text), from_hf(dict(text, model_type="glm5_next_text"))


def hf_kda(hf_config, dtype, seed: int):
    """transformers' KDA layer with weights away from its initialisation (decays spread, norms not 1)."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextLinearAttention

    module = Glm5NextTextLinearAttention(hf_config, 0).to(dtype).train()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=F64)
            if name.endswith("o_norm.weight"):
                p.copy_(1 + 0.1 * noise)
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(0.5 * noise)
            else:
                p.copy_((0.5 if "conv1d" in name else 0.3) * noise)
    return module


def on_disk(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' in-memory KDA names -> the checkpoint's (its conversion_mapping.py "glm5_next"): the one
    conv1d as q/k/v_conv1d, the forget gate's tensors directly under self_attn."""
    out = {}
    for name, t in named.items():
        if name == "conv1d.weight":
            out.update(zip(("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"), t.chunk(3)))
        else:
            out[name.removeprefix("forget_gate.")] = t
    return out


def ours_from(hf_module, arch, dtype, tp_rank: int = 0, tp: int = 1):
    """Our layer (megatron's parallel state already initialised) holding this TP rank's shards."""
    from slime_plugins.models.glm5_next.kda import KimiDeltaAttention, kda_weight_maps

    module = KimiDeltaAttention(arch.transformer_config(tp=tp, dtype=dtype), 1, arch)
    ours, theirs = dict(module.named_parameters()), on_disk(dict(hf_module.named_parameters()))
    maps = kda_weight_maps(arch, "a", "h")
    assert sorted(m.param[2:] for m in maps) == sorted(ours) and sorted(m.hf[0][2:] for m in maps) == sorted(theirs)
    with torch.no_grad():
        for m in maps:
            ours[m.param[2:]].copy_(m.to_local([theirs[m.hf[0][2:]]], tp_rank, tp))
    return module.train()


def rank_step(tp: int, cp: int) -> dict:
    """This rank's forward/backward on PARALLEL_LENGTHS: output and input-grad rows (global row numbers) and
    parameter grads (megatron names)."""
    from megatron.core import parallel_state as ps

    from slime_plugins.models.common.context_parallel import build_layout
    from slime_plugins.models.common.rope import ForwardContext

    hf_config, arch = configs()
    tp_rank, cp_rank = ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank()
    layer = ours_from(hf_kda(hf_config, F64, 1), arch, F64, tp_rank, tp)
    g = torch.Generator().manual_seed(11)
    total = sum(PARALLEL_LENGTHS)
    x = torch.randn(total, arch.hidden_size, generator=g, dtype=F64)
    weight = torch.randn(total, arch.hidden_size, generator=g, dtype=F64)
    cu = torch.tensor([0, *torch.tensor(PARALLEL_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    layout = build_layout(cu, cp, cp_rank, group=ps.get_context_parallel_group()) if cp > 1 else None
    rows = layout.local_index if layout is not None else torch.arange(total)
    seg = layout.cu_seqlens_q if layout is not None else cu
    ctx = ForwardContext(qkv_format="thd", cu_seqlens_q=seg, cu_seqlens_kv=seg, cu_seqlens=seg, batch=1,
                         seq_len=rows.numel(), cp=layout)
    rows = rows.chunk(tp)[tp_rank]  # sequence parallel: this TP rank's slice of the local tokens
    local = x[rows].unsqueeze(1).requires_grad_(True)
    out = layer(local, packed_seq_params=ctx)[0][:, 0]
    (out * weight[rows]).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return dict(rows=rows, out=out.detach(), x_grad=local.grad[:, 0].clone(), grads=grads, tp_rank=tp_rank)


def run(rank: int, world: int, port: int, tp: int, cp: int, out_dir: str) -> None:
    from glm5_helpers import init_rank

    from slime.backends.megatron.parallel import init_parallel

    init_rank(rank, world, port)
    init_parallel(tp=tp, cp=cp)
    torch.save(rank_step(tp, cp), f"{out_dir}/rank{rank}.pt")
