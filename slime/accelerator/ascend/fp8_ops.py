"""Ascend mapping of the block-FP8 quantization op (`fp8_block_quantize`, reference slime/accelerator/ops/fp8.py),
part of the "npu" provider: the weight sync quantizes GLM-5.3-Flash's expert weights for an FP8 engine with it.

What is documented (tests/data/npu_fp8_facts.json; read, never run on hardware):
- torch_npu.npu_dynamic_block_quant(x, *, min_scale=0.0, round_mode="rint", dst_type=1, row_block_size=1,
  col_block_size=128[, dst_type_max=0.0]) -> (y, scale): in every torch-npu wheel from 2.7.1 (Ascend PyTorch 7.2.0).
  Its torch_npu page lists Atlas A2/A3 and int8 output only; its meta registration notes "dst_type only support
  torch.int8 in 910B/C" and shapes the scale [.., ceil(rows / row_block_size), ceil(cols / col_block_size)].
- CANN's operator behind it (ops-nn DynamicBlockQuant) adds the Ascend 950PR/950DT with float8_e4m3fn / e5m2 /
  hifloat8 output, 2-D or 3-D x, row blocks 1/128/256/512 and column blocks 64/128/192/256; scale = amax / 448 per
  block for e4m3, y = x / scale rounded to nearest even; an all-zero block gets scale 0. vllm-ascend (A5 sparse
  attention caches) and MindSpeed (FP8 block recipes) call it with dst_type=torch.float8_e4m3fn.
So on a 950 the kernel serves bf16 / fp16 weights in the checkpoint's [128, 128] blocks; A2/A3 (int8 only), other
dtypes, block sizes and ranks take the reference. The one-time start-up probe compares it with the reference on a
pack with partial blocks and an all-zero block; a failing probe keeps the reference (one log line).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch

from slime.accelerator.ascend.support import is_950, release_key, release_of, requirement, soc_of
from slime.accelerator.ops import DeviceOp
from slime.accelerator.ops import fp8 as fp8_reference

OPS = ("fp8_block_quantize",)
KERNEL = "npu_dynamic_block_quant"
SINCE = "7.2.0"  # first Ascend PyTorch release whose wheels (2.7.1, 2.8.0) define it
ROW_BLOCKS = (1, 128, 256, 512)  # ops-nn, Ascend 950
COL_BLOCKS = (64, 128, 192, 256)
INPUT_DTYPES = (torch.bfloat16, torch.float16)  # torch_npu's page; ops-nn adds float32 on the 950 (not relied on)
KERNEL_CALLS: dict[str, int] = {}
_DEVICE_TYPE = ["npu"]  # the accelerator's tensors (the simulator's live on the host); set by resolve


def _kernel() -> Callable:
    KERNEL_CALLS[KERNEL] = KERNEL_CALLS.get(KERNEL, 0) + 1
    npu = importlib.import_module("torch_npu")
    fn = getattr(npu, KERNEL, None)
    return fn if fn is not None else getattr(torch.ops.npu, KERNEL)


def fp8_block_quantize(weight: torch.Tensor, block: tuple[int, int] = (128, 128),
                       dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = block
    # A weight the sync holds in host memory is quantized there (the kernel takes device tensors only).
    if dtype != torch.float8_e4m3fn or weight.dim() not in (2, 3) or weight.dtype not in INPUT_DTYPES \
            or rows not in ROW_BLOCKS or cols not in COL_BLOCKS or weight.numel() == 0 \
            or weight.device.type != _DEVICE_TYPE[0]:
        return fp8_reference.fp8_block_quantize(weight, block, dtype)
    q, scale = _kernel()(weight.contiguous(), dst_type=torch.float8_e4m3fn, row_block_size=rows, col_block_size=cols)
    # An all-zero block: the kernel's scale is 0 (its values 0); the checkpoint format's is 1.
    return q, torch.where(scale == 0, torch.ones_like(scale), scale).to(torch.float32)


def probe(fn: Callable, device: torch.device) -> str:
    """'' when the kernel's blocks dequantize to the reference's within one e4m3 step, else why not."""
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(300, 260, generator=gen) * torch.logspace(-3, 1, 260)).to(torch.bfloat16)
    w[128:256, 128:256] = 0  # an all-zero block
    before = KERNEL_CALLS.get(KERNEL, 0)
    try:
        q, s = fn(w.to(device), (128, 128))
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if KERNEL_CALLS.get(KERNEL, 0) == before:
        return "the probe's input did not reach the kernel"
    q_ref, s_ref = fp8_reference.fp8_block_quantize(w, (128, 128))
    if q.dtype != torch.float8_e4m3fn or tuple(s.shape) != tuple(s_ref.shape):
        return f"got {q.dtype} values and scales {tuple(s.shape)}, expected float8_e4m3fn and {tuple(s_ref.shape)}"
    scale_err = float(((s.cpu().double() - s_ref.double()).abs() / s_ref.double()).max())
    if scale_err > 1e-6:
        return f"block scales off the reference by {scale_err:.2e} (relative)"
    deq = q.cpu().double() * fp8_reference.expand_blocks(s.cpu().double(), *w.shape, (128, 128))
    ref = q_ref.double() * fp8_reference.expand_blocks(s_ref.double(), *w.shape, (128, 128))
    step = 0.125 * ref.abs() + fp8_reference.expand_blocks(s_ref.double(), *w.shape, (128, 128)) * 2.0 ** -9
    over = float(((deq - ref).abs() - step).max())
    return f"dequantized values off the reference by more than one e4m3 step ({over:.2e} over)" if over > 0 else ""


_PROBED: dict[str, str] = {}


def resolve(op_name: str, acc: Any) -> DeviceOp:
    """torch_npu has the kernel (Ascend PyTorch >= 7.2.0), the SoC writes FP8 with it (the 950), and the probe passes."""
    try:
        npu = importlib.import_module("torch_npu")
    except Exception as e:
        return DeviceOp(None, "", f"import torch_npu failed: {type(e).__name__}: {e}")
    version = str(getattr(npu, "__version__", "unknown"))
    release = release_of(version)
    if release is None or release_key(release) < release_key(SINCE):
        return DeviceOp(None, "", f"torch_npu {version} predates torch_npu.{KERNEL} (needs {requirement(SINCE)})")
    if getattr(npu, KERNEL, None) is None:
        return DeviceOp(None, "", f"torch_npu {version} lacks {KERNEL}; needs {requirement(SINCE)}")
    soc = soc_of(acc.device_name())
    if not is_950(soc):
        return DeviceOp(None, "", f"torch_npu.{KERNEL} writes int8 only on {soc} (CANN's DynamicBlockQuant: FP8 "
                                  f"output on the Ascend 950 only); block FP8 is quantized by the reference")
    _DEVICE_TYPE[0] = acc.device().type
    if op_name not in _PROBED:
        _PROBED[op_name] = probe(fp8_block_quantize, acc.device())
    if _PROBED[op_name]:
        return DeviceOp(None, "", f"probe of torch_npu.{KERNEL} on {soc} failed: {_PROBED[op_name]}")
    return DeviceOp(fp8_block_quantize, f"torch_npu.{KERNEL}")


def forget_probes() -> None:
    _PROBED.clear()
