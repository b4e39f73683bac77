"""Block-FP8 checkpoints in the embedded engine (GLM-5.3-Flash's `zai-org/GLM-5.3-Flash`: e4m3 weights with a
float32 `X.weight_scale_inv` per block, config.json `quantization_config`, slime/utils/fp8_blocks.py).

The engine computes in the checkpoint's high precision (float32 on CPU): every block-FP8 weight is dequantized
once, at load or when an update brings one, as w = q * scale_inv block by block with the checkpoint's
`weight_block_size` (partial last blocks keep a scale of their own). transformers' own FP8 dequantization on a
host derives the block from the scale grid and refuses rows or columns that are not a multiple of it, so the
engine reads these checkpoints itself: the model is built from its config, then every tensor is loaded by its
checkpoint name through the engine's WeightNameMap (weights.plan_disk_update), the FP8 ones dequantized.

Checked before anything is read, by the pairing the trainer's HF reader uses too (slime/utils/fp8_pairs.py): an
FP8 weight without its scale, a scale without its FP8 weight, a scale grid that does not fit its weight, an FP8
weight in a module the config's `modules_to_not_convert` keeps in high precision (an engine would serve its raw
e4m3 values there), each one line naming the tensor and the fix.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import torch

from slime.backends.embedded.errors import BadRequest
from slime.utils.fp8_blocks import SCALE_SUFFIX, Fp8FormatError, dequantize
from slime.utils.fp8_pairs import FLOAT8 as FLOAT8  # re-exported for the engine's modules
from slime.utils.fp8_pairs import Fp8Layout as Fp8Layout
from slime.utils.fp8_pairs import pair_scales


def layout_of_dir(model_path: str) -> Fp8Layout | None:
    """The layout `model_path`'s config.json states (top level or text_config); None without fp8 quantization
    (or without a readable config.json); BadRequest for a format that is not read."""
    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    try:
        return Fp8Layout.from_config(config)
    except Fp8FormatError as e:
        raise BadRequest(f"{model_path}: {e}") from e


def fold_scales(specs: list[tuple[str, Any, torch.dtype]], layout: Fp8Layout,
                source: str) -> tuple[list[tuple[str, Any, torch.dtype]], dict[str, str]]:
    """(specs with each block-FP8 weight as the float32 tensor it dequantizes to and its scale dropped,
    {FP8 weight: its scale's name}). BadRequest, one line, for a malformed pair (slime.utils.fp8_pairs);
    `source` names where the tensors come from."""
    try:
        pairs = pair_scales(specs, layout)
    except Fp8FormatError as e:
        raise BadRequest(f"{source}: {e}") from e
    folded = [(n, shape, torch.float32 if n in pairs else dt) for n, shape, dt in specs
              if not n.endswith(SCALE_SUFFIX)]
    return folded, pairs


def dequantized(weight: torch.Tensor, scale_inv: torch.Tensor, layout: Fp8Layout, name: str) -> torch.Tensor:
    """The float32 weight of a block-FP8 pair (checked by fold_scales)."""
    try:
        return dequantize(weight, scale_inv, layout.fmt.block, torch.float32, name=name)
    except Fp8FormatError as e:
        raise BadRequest(f"weight update rejected, nothing changed: {e}") from e


def dequantize_named(named: list[tuple[str, torch.Tensor]], layout: Fp8Layout, source: str = "weight update",
                     dtype_of: Callable[[str], torch.dtype] | None = None) -> list[tuple[str, torch.Tensor]]:
    """An update's tensors with each (FP8 weight, its scale) pair replaced by the weight dequantized (in
    `dtype_of(name)`, default float32): what the sender's fp8_blocks.quantize_named writes for an FP8 engine.
    Other tensors pass unchanged."""
    if not any(t.dtype in FLOAT8 or n.endswith(SCALE_SUFFIX) for n, t in named):
        return named
    _, pairs = fold_scales([(n, t.shape, t.dtype) for n, t in named], layout, source)
    tensors = dict(named)

    def high_precision(name: str, q: torch.Tensor) -> torch.Tensor:
        w = dequantized(q, tensors[pairs[name]], layout, name)
        return w.to(dtype_of(name)) if dtype_of is not None else w

    return [(n, high_precision(n, t) if n in pairs else t) for n, t in named if not n.endswith(SCALE_SUFFIX)]
