"""Reference of the block-FP8 quantization op (`fp8_block_quantize`): a weight in the format DeepSeek-V3-style
checkpoints store (GLM-5.3-Flash's experts, slime/utils/fp8_blocks.py): float8 e4m3 values and one float32
`scale_inv` per [rows, cols] block of the last two dimensions, w = q * scale_inv block by block.

Per block scale_inv = amax / 448 (1 for an all-zero block, so it dequantizes to zeros), q = w / scale_inv rounded
to e4m3 (round to nearest even), clamped to +-448. Partial last blocks get a scale of their own. Computed in float32
(float64 input: float64); the weight sync sends an FP8 engine its weights in this format (quantize_named).
"""

from __future__ import annotations

import math

import torch

__all__ = ["E4M3_MAX", "fp8_block_quantize"]

E4M3_MAX = 448.0  # largest finite float8_e4m3fn value


def expand_blocks(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """One scale per element: each block's scale repeated over its block, the partial last blocks cropped."""
    full = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return full[..., :rows, :cols]


def fp8_block_quantize(weight: torch.Tensor, block: tuple[int, int] = (128, 128),
                       dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """(q in `dtype`, float32 scale_inv [..., ceil(rows / block[0]), ceil(cols / block[1])]) of a weight of at
    least 2 dimensions."""
    if weight.dim() < 2:
        raise ValueError(f"block FP8 needs a weight of at least 2 dimensions, got {tuple(weight.shape)}")
    *lead, rows, cols = weight.shape
    nr, nc = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    compute = torch.float64 if weight.dtype == torch.float64 else torch.float32
    padded = torch.zeros(*lead, nr * block[0], nc * block[1], dtype=compute, device=weight.device)
    padded[..., :rows, :cols] = weight.to(compute)
    blocks = padded.reshape(*lead, nr, block[0], nc, block[1])
    amax = blocks.abs().amax(dim=(-3, -1))
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (weight.to(compute) / expand_blocks(scale_inv, rows, cols, block)).clamp(-E4M3_MAX, E4M3_MAX).to(dtype)
    return q, scale_inv.to(torch.float32)
