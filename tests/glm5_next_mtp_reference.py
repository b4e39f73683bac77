"""GLM-5.3-Flash's MTP layer for the conformance suite (tests/model_conformance.py, the glm5_next_mtp case): the
tiny checkpoint with its MTP layer as the published one is stored (tests/glm5_next_helpers.add_mtp_layer: layer N,
no hc_*), and the float64 reference of its depth-1 logits. transformers 5.24 has no MTP module for glm5_next (it
skips layer 45 on load), so the reference is built from transformers' own modules: the main model, then
Glm5NextTextAttention with its indexer, Glm5NextTextMoE and Glm5NextTextRMSNorm around a plain residual, as SGLang
0.5.23's draft model runs the layer (DeepseekV2DecoderLayer: no mHC)."""

from __future__ import annotations

import copy
import os

import torch
from safetensors.torch import load_file


def write_mtp_checkpoint(case, path: str, seed: int, initializer_range: float = 0.2, **overrides) -> str:
    """The multimodal tiny checkpoint of tests/glm5_next_helpers.hf_reference (non-trivial mHC base / scale,
    expert biases, norms) saved by transformers, with its MTP layer added."""
    from glm5_next_helpers import add_mtp_layer, hf_reference

    assert initializer_range == 0.2, "hf_reference writes initializer_range 0.2"
    hf_reference(seed, **overrides).save_pretrained(path)
    return add_mtp_layer(path)


class TransformersMtp(torch.nn.Module):
    """The MTP layer of `ckpt` from transformers' modules (float64), under the checkpoint's names."""

    def __init__(self, reference, ckpt: str) -> None:
        super().__init__()
        from transformers.models.glm5_next import modeling_glm5_next as hf

        config = copy.deepcopy(reference.config.text_config)
        n, h = config.num_hidden_layers, config.hidden_size
        config.layer_types = list(config.layer_types) + ["indexed_attention"]  # the MTP layer: a full DSA layer
        config.indexer_types = list(config.indexer_types) + ["full"]
        config.mlp_layer_types = list(config.mlp_layer_types) + ["sparse"]
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"  # torch's grouped_mm has no float64
        prefix = f"model.language_model.layers.{n}."
        own = {k[len(prefix):]: v.double() for k, v in load_file(os.path.join(ckpt, "model.safetensors")).items()
               if k.startswith(prefix)}
        self.experts = config.n_routed_experts
        for name in ("enorm", "hnorm", "input_layernorm", "post_attention_layernorm", "shared_head_norm"):
            setattr(self, name, hf.Glm5NextTextRMSNorm(h, config.rms_norm_eps))
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.self_attn = hf.Glm5NextTextAttention(config, n)
        self.mlp = hf.Glm5NextTextMoE(config)
        self.double()
        own["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([own.pop(f"mlp.experts.{e}.gate_proj.weight"),
                                                                  own.pop(f"mlp.experts.{e}.up_proj.weight")])
                                                       for e in range(self.experts)])
        own["mlp.experts.down_proj"] = torch.stack([own.pop(f"mlp.experts.{e}.down_proj.weight")
                                                    for e in range(self.experts)])
        own["shared_head_norm.weight"] = own.pop("shared_head.norm.weight")
        self.load_state_dict(own, strict=True)

    def forward(self, main, ids):
        text = main.model.language_model
        hidden = text(input_ids=ids).last_hidden_state  # h_0: after the streams' collapse and the final norm
        ahead = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)  # token t + 1 at row t (0 past the end)
        x = self.eh_proj(torch.cat([self.enorm(text.embed_tokens(ahead)), self.hnorm(hidden)], dim=-1))
        x = x + self.self_attn(self.input_layernorm(x), attention_mask=torch.ones(ids.shape, dtype=torch.bool))[0]
        x = x + self.mlp(self.post_attention_layernorm(x))
        return main.lm_head(self.shared_head_norm(x))

    def grads(self, n: int) -> dict[str, torch.Tensor | None]:
        """Grads under the checkpoint's names (experts split per expert; the expert bias, a buffer: None)."""
        prefix, out = f"model.language_model.layers.{n}.", {}
        for name, p in list(self.named_parameters()) + list(self.named_buffers()):
            if name.startswith("mlp.experts."):
                for e in range(self.experts):
                    g = None if p.grad is None else p.grad[e]
                    if name.endswith("gate_up_proj"):
                        half = None if g is None else g.chunk(2)
                        out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = None if g is None else half[0]
                        out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = None if g is None else half[1]
                    else:
                        out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = g
                continue
            out[prefix + name.replace("shared_head_norm", "shared_head.norm")] = p.grad
        return out


class MtpReference(torch.nn.Module):
    """float64: reference(ids) -> depth-1 MTP logits [B, S, V] (transformers' main model, then the MTP layer);
    grads() -> the grads of what was backpropagated, main model's and MTP layer's, under the checkpoint's names."""

    def __init__(self, main, ckpt: str) -> None:
        super().__init__()
        self.main = copy.deepcopy(main).double()
        self.main.set_experts_implementation("eager")  # torch's grouped_mm has no float64
        self.mtp = TransformersMtp(main, ckpt)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from slime.accelerator.transformers_patches import StableTopk

        with StableTopk():  # slime's top-k tie rule in transformers' indexers
            return self.mtp(self.main, ids)

    def grads(self) -> dict[str, torch.Tensor | None]:
        from glm5_next_helpers import hf_grads_on_disk

        return hf_grads_on_disk(self.main) | self.mtp.grads(self.main.config.text_config.num_hidden_layers)


def mtp_reference(case, ckpt: str) -> MtpReference:
    """The conformance suite's hook: the reference of the case's checkpoint."""
    from model_conformance import reference_model

    return MtpReference(reference_model(case, ckpt), ckpt)
