"""SIMULATED npu_dynamic_block_quant: the documented contract (tests/data/npu_fp8_facts.json), float64 math.

torch_npu's page (every wheel 2.7.1 .. 2.14.0): x float16/bfloat16, 2-D or 3-D; A2/A3 write int8 only (dst_type 1),
row blocks of 1 (or 128) and column blocks of 128. CANN's operator (ops-nn DynamicBlockQuant) on the Ascend 950:
float8_e4m3fn / float8_e5m2 / int8 output, row blocks 1/128/256/512, column blocks 64/128/192/256, round_mode rint.
Per block scale = max(amax / dst max, min_scale) (float32), y = x / scale rounded (a zero scale gives 0).
dst_type is given as callers pass it: a torch dtype (vllm-ascend, MindSpeed) or its ScalarType number.
"""

from __future__ import annotations

import math

import torch

from ._common import check, fail, is_950, soc

OP = "npu_dynamic_block_quant"
_BY_NUMBER = {1: torch.int8, 23: torch.float8_e5m2, 24: torch.float8_e4m3fn, 291: torch.float8_e5m2,
              292: torch.float8_e4m3fn}
_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _dst(dst_type) -> torch.dtype:
    dtype = dst_type if isinstance(dst_type, torch.dtype) else _BY_NUMBER.get(dst_type)
    if dtype not in _MAX:
        raise fail(OP, f"dst_type {dst_type!r} is not simulated (int8, float8_e4m3fn, float8_e5m2)")
    return dtype


def npu_dynamic_block_quant(x, *, min_scale=0.0, round_mode="rint", dst_type=1, row_block_size=1,
                            col_block_size=128, dst_type_max=0.0):
    dtype = _dst(dst_type)
    check(x.dtype in (torch.float16, torch.bfloat16), OP, f"x must be float16 or bfloat16, got {x.dtype}")
    check(min_scale >= 0 and dst_type_max == 0.0 and round_mode == "rint", OP,
          "min_scale >= 0, dst_type_max 0 and round_mode 'rint' are simulated")
    if is_950():
        check(x.dim() in (2, 3), OP, f"x must be 2-D or 3-D, got {x.dim()}-D")
        check(row_block_size in (1, 128, 256, 512) and col_block_size in (64, 128, 192, 256), OP,
              f"block [{row_block_size}, {col_block_size}] not supported (rows 1/128/256/512, cols 64/128/192/256)")
    else:
        check(dtype == torch.int8, OP, f"on {soc()} dst_type must be int8 (1), got {dtype}")
        check(x.dim() == 2 and row_block_size in (1, 128) and col_block_size == 128, OP,
              f"on {soc()} x must be 2-D with blocks [1 or 128, 128]")
    *lead, rows, cols = x.shape
    nr, nc = math.ceil(rows / row_block_size), math.ceil(cols / col_block_size)
    padded = torch.zeros(*lead, nr * row_block_size, nc * col_block_size, dtype=torch.float64)
    padded[..., :rows, :cols] = x.double()
    amax = padded.reshape(*lead, nr, row_block_size, nc, col_block_size).abs().amax(dim=(-3, -1))
    scale = torch.clamp(amax / _MAX[dtype], min=min_scale).float()
    per_element = scale.double().repeat_interleave(row_block_size, -2).repeat_interleave(col_block_size, -1)
    per_element = per_element[..., :rows, :cols]
    y = torch.where(per_element > 0, x.double() / per_element.clamp(min=1e-300), torch.zeros_like(per_element))
    y = y.clamp(-_MAX[dtype], _MAX[dtype])
    y = y.round().to(dtype) if dtype == torch.int8 else y.float().to(dtype)
    return y.to(x.device), scale.to(x.device)
