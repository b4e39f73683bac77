"""Block-scaled FP8 weights as DeepSeek-V3-style checkpoints store them (GLM-5.3-Flash's `zai-org/GLM-5.3-Flash`:
routed, shared and MTP experts): `X.weight` in float8 e4m3 and `X.weight_scale_inv` in float32, one scale per
[128, 128] block of the weight's last two dimensions (config.json `quantization_config`: quant_method "fp8",
fmt "e4m3", weight_block_size [128, 128]). The stored scale multiplies: w = q * scale_inv, block by block.

A dimension that is not a multiple of the block has a last, partial block with a scale row (column) of its
own, so a [576, H] weight has ceil(576 / 128) = 5 scale rows. Projections an engine merges (gate + up) keep
one scale grid per checkpoint tensor: a merged [1152, H] weight quantized as one would have 9 scale rows, not
5 + 5, and the last gate block would share a scale with the first up rows. `quantize_named` therefore works
per checkpoint tensor, before any merge.

Used by the HF reader (slime/backends/megatron/hf_io.py: FP8 tensors read dequantized, for training) and for
sending weights to an FP8 rollout engine in the checkpoint's own format (`quantize_named`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from slime.accelerator.ops.fp8 import E4M3_MAX as E4M3_MAX  # re-exported: the checkpoint format's bound
from slime.accelerator.ops.fp8 import expand_blocks, fp8_block_quantize

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
DEFAULT_BLOCK = (128, 128)


class Fp8FormatError(ValueError):
    """A block-FP8 tensor whose scale grid does not fit its weight, or a config this reader does not handle."""


@dataclass(frozen=True)
class Fp8BlockFormat:
    """How a checkpoint stores its FP8 weights (config.json's quantization_config)."""

    block: tuple[int, int] = DEFAULT_BLOCK
    dtype: torch.dtype = torch.float8_e4m3fn

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Fp8BlockFormat | None":
        """The format of `config.json` (top level, or a multimodal checkpoint's text_config); None when it states
        no fp8 quantization."""
        q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
        if not q or q.get("quant_method") != "fp8":
            return None
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise Fp8FormatError(f"quantization_config fmt {fmt!r}: only e4m3 block FP8 is read; "
                                 "convert the checkpoint to bf16 or e4m3")
        block = tuple(int(b) for b in q.get("weight_block_size") or DEFAULT_BLOCK)
        if len(block) != 2 or min(block) < 1:
            raise Fp8FormatError(f"quantization_config weight_block_size {list(block)}: expected two positive sizes")
        return cls(block=block)  # type: ignore[arg-type]


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...] | torch.Size, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[int, ...]:
    """The scale grid of a weight: leading dimensions kept, the last two divided by the block, rounded up."""
    *lead, rows, cols = tuple(shape)
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK,
               dtype: torch.dtype = torch.float32, name: str = "weight") -> torch.Tensor:
    """w = q * scale_inv per block, in `dtype` (float32: exact products of e4m3 values and float32 scales
    up to one rounding)."""
    if weight.dim() < 2:
        raise Fp8FormatError(f"{name}: a block-FP8 weight has at least 2 dimensions, got {tuple(weight.shape)}")
    want = scale_shape(weight.shape, block)
    if tuple(scale_inv.shape) != want:
        raise Fp8FormatError(f"{scale_name(name)} has shape {tuple(scale_inv.shape)}, but a "
                             f"{tuple(weight.shape)} weight in {list(block)} blocks needs {want}")
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    rows, cols = weight.shape[-2:]
    out = weight.to(compute) * expand_blocks(scale_inv.to(compute), rows, cols, block)
    return out.to(dtype)


def quantize(weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK,
             dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale_inv) in the checkpoint's format: per block scale_inv = amax / 448 (1 for an all-zero block, so
    it dequantizes to zeros), q = w / scale_inv rounded to e4m3. Computed in float32 (float64 input: float64).
    The pure-torch reference of the op table's `fp8_block_quantize` (slime/accelerator/ops/fp8.py)."""
    if weight.dim() < 2:
        raise Fp8FormatError(f"block FP8 needs a weight of at least 2 dimensions, got {tuple(weight.shape)}")
    return fp8_block_quantize(weight, tuple(block), dtype)


def _device_quantize(tensor: torch.Tensor, fmt: Fp8BlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """The op table's fp8_block_quantize (e4m3, the only format it serves), else the reference here."""
    if tensor.dim() < 2 or fmt.dtype != torch.float8_e4m3fn:
        return quantize(tensor, fmt.block, fmt.dtype)
    from slime.accelerator import get_accelerator

    return get_accelerator().ops.fp8_block_quantize(tensor, tuple(fmt.block))


def quantize_named(named: Iterable[tuple[str, torch.Tensor]], fp8_names: set[str] | frozenset[str],
                   fmt: Fp8BlockFormat = Fp8BlockFormat()) -> Iterator[tuple[str, torch.Tensor]]:
    """Weights for an FP8 engine in the checkpoint's format: each tensor the checkpoint stores in FP8 becomes
    (name, e4m3 q) and (name + "_scale_inv", float32 scales), quantized as that one checkpoint tensor (never
    merged with its gate/up partner first), on the device where the op table has a kernel for it (the Ascend 950's
    block quantization, slime/accelerator/ascend/fp8_ops.py); every other tensor passes unchanged."""
    for name, tensor in named:
        if name not in fp8_names:
            yield name, tensor
            continue
        q, scale_inv = _device_quantize(tensor, fmt)
        yield name, q
        yield scale_name(name), scale_inv
