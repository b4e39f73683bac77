"""Small building blocks: RMSNorm (sequence-parallel aware), replicated linear, SwiGLU MLP (TP-split),
[S, B] <-> THD token layout."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule

from slime.accelerator import get_accelerator


def to_thd(x: torch.Tensor) -> torch.Tensor:
    """[S, B, ...] -> [B*S, ...] with each sequence's tokens contiguous."""
    return x.transpose(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def from_thd(x: torch.Tensor, seq_len: int, batch: int) -> torch.Tensor:
    return x.reshape(batch, seq_len, *x.shape[1:]).transpose(0, 1)


class KeepsFloat32:
    """Mixin: the listed parameters / buffers stay float32 when the module is cast (model.to(bf16)),
    as transformers keeps the router weight, expert bias and indexer gate in float32."""

    float32_names: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        saved = {n: self._tensor(n).data for n in self.float32_names}  # the tensors, not the Parameter objects
        super()._apply(fn, recurse)
        for name, old in saved.items():
            new = self._tensor(name)
            if new.dtype != torch.float32 and old.dtype == torch.float32:
                if isinstance(new, torch.nn.Parameter):
                    new.data = old.detach().to(new.device)
                else:
                    owner, _, leaf = name.rpartition(".")
                    (self.get_submodule(owner) if owner else self)._buffers[leaf] = old.to(new.device)
        return self

    def _tensor(self, name: str) -> torch.Tensor:
        try:
            return self.get_parameter(name)
        except AttributeError:
            return self.get_buffer(name)


class RMSNorm(MegatronModule):
    """RMSNorm through `ops.rms_norm`. Built by megatron's TransformerLayer/Block as
    `RMSNorm(config=, hidden_size=, eps=)`. On sequence-parallel activations its weight is marked
    `sequence_parallel` so megatron all-reduces its grad over TP; inside attention (full, gathered
    tokens on every TP rank) pass sequence_parallel=False. With config.layernorm_zero_centered_gamma
    (Megatron's --apply-layernorm-1p; Qwen3-Next / Qwen3.5) the stored weight is zero-centred: the scale is
    1 + weight, applied in float32 before the cast back (transformers' Qwen3NextRMSNorm order)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, sequence_parallel: bool | None = None) -> None:
        super().__init__(config=config)
        self.eps = float(eps)
        self.zero_centered = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        sp = config.sequence_parallel if sequence_parallel is None else sequence_parallel
        self.weight.sequence_parallel = bool(sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centered:
            return get_accelerator().ops.rms_norm(x.float(), 1.0 + self.weight.float(), self.eps).to(x.dtype)
        return get_accelerator().ops.rms_norm(x, self.weight, self.eps)


class ReplicatedLinear(torch.nn.Module):
    """`y = x W^T (+ b)` with the full weight on every TP rank (small MLA down-projections, indexer).
    Its inputs are the full (sequence-gathered) tokens, so every TP rank computes the same grads."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        torch.nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def column_parallel(config, in_features: int, out_features: int, *, bias: bool = False, gather_output: bool = False,
                    sequence_parallel: bool | None = None, tp_comm_buffer_name: str | None = None,
                    stride: int = 1) -> ColumnParallelLinear:
    """megatron ColumnParallelLinear; sequence_parallel=False for inputs that are already full on every
    TP rank (then the input grad is all-reduced instead of reduce-scattered). stride=2: the output rows
    are two halves ([gate; up]) each split over TP."""
    layer = ColumnParallelLinear(in_features, out_features, config=config, init_method=config.init_method, bias=bias,
                                 gather_output=gather_output, skip_bias_add=False, stride=stride)
    if sequence_parallel is False and layer.sequence_parallel:
        layer.sequence_parallel = False
        layer.allreduce_dgrad = layer.tp_group.size() > 1
    return layer


def row_parallel(config, in_features: int, out_features: int, *, bias: bool = False) -> RowParallelLinear:
    return RowParallelLinear(in_features, out_features, config=config, init_method=config.output_layer_init_method,
                             bias=bias, input_is_parallel=True, skip_bias_add=False)


def clamp_gate_up(x: torch.Tensor, limit: float | None) -> torch.Tensor:
    """SwiGLU input [..., gate | up] with gate <= limit and -limit <= up <= limit (GLM-5.3-Flash's clamped SwiGLU);
    x itself when limit is None. A plain torch op before `ops.swiglu`, so every device's fused SwiGLU serves it."""
    if limit is None:
        return x
    gate, up = x.chunk(2, dim=-1)
    return torch.cat([gate.clamp(max=limit), up.clamp(min=-limit, max=limit)], dim=-1)


class SwiGLUMLP(MegatronModule):
    """Dense / shared-expert MLP: fc1 holds this TP rank's [gate; up] rows, `ops.swiglu`, fc2 row-parallel.
    Input/output follow megatron's layout ([S(/tp), B, H] with sequence parallel). `swiglu_limit` (set by a
    family whose checkpoints clamp, e.g. glm5_next) clamps the SwiGLU input (clamp_gate_up)."""

    swiglu_limit: float | None = None

    def __init__(self, config, ffn_hidden_size: int | None = None, **_: object) -> None:
        super().__init__(config=config)
        ffn = config.ffn_hidden_size if ffn_hidden_size is None else ffn_hidden_size
        self.ffn_hidden_size = ffn
        self.linear_fc1 = column_parallel(config, config.hidden_size, 2 * ffn, stride=2)  # [gate; up] per rank
        self.linear_fc2 = row_parallel(config, ffn, config.hidden_size)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """fc1 holds this rank's slice of gate AND of up: stored as megatron's gated MLP stores it (gate rows,
        then up rows, each split over TP), so the checkpoint is the same at every TP size."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        key = f"{prefix}linear_fc1.weight"
        state[key] = apply_swiglu_sharded_factory(state[key], sharded_offsets)
        return state

    def forward(self, x: torch.Tensor, padding_mask=None):
        h, _ = self.linear_fc1(x)
        out, _ = self.linear_fc2(get_accelerator().ops.swiglu(clamp_gate_up(h, self.swiglu_limit)))
        return out, None
