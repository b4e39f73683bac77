"""Shared helpers of the GLM-5 model tests: tiny checkpoints, transformers references, grads by HF name."""

from __future__ import annotations

import torch

# Larger than the writer's default init (0.02) so attention is far from uniform and DSA's token dropping
# changes the logits measurably.
INIT = dict(initializer_range=0.2)
VOCAB_LOW = 3  # token ids >= 3: the pad row (0) of transformers' embedding gets no gradient


def write_checkpoint(path, model_type: str, seed: int = 0, **overrides) -> str:
    from slime_plugins.models.glm5.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(str(path), model_type=model_type, seed=seed, **(INIT | overrides))


def hf_model(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.train()  # dropout is 0; train mode as the trainer uses


def hf_grads_by_checkpoint_name(model) -> dict[str, torch.Tensor]:
    """transformers' in-memory grads under checkpoint names (fused experts split per expert)."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, half = name.removesuffix(".gate_up_proj"), p.shape[1] // 2
            for e, g in enumerate(p.grad):
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = g[:half], g[half:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e, g in enumerate(p.grad):
                out[f"{prefix}.{e}.down_proj.weight"] = g
        else:
            out[name] = p.grad
    return out


def megatron_grads_by_hf_name(model, gather=None) -> dict[str, torch.Tensor]:
    """Our grads under HF names. `gather(tensor, kind)` returns the list of shards (TP/EP > 1)."""
    from slime_plugins.models.glm5.weights import maps_for_model

    state = model.state_dict(keep_vars=True)
    out = {}
    for m in maps_for_model(model):
        grad = getattr(state[m.param], "grad", None)
        if grad is None:
            continue
        shards = gather(grad, m.kind) if gather else [grad]
        out.update(zip(m.hf_names_after_gather(model.glm.n_routed_experts), m.to_hf(shards)))
    return out


def random_batch(batch: int, seq: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(VOCAB_LOW, vocab, (batch, seq), generator=g)
    return ids, torch.arange(seq).expand(batch, seq).contiguous()
