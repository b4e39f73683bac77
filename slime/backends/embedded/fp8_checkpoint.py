"""Block-FP8 checkpoints in the embedded engine (GLM-5.3-Flash's `zai-org/GLM-5.3-Flash`: e4m3 weights with a
float32 `X.weight_scale_inv` per block, config.json `quantization_config`, slime/utils/fp8_blocks.py).

The engine computes in the checkpoint's high precision (float32 on CPU): every block-FP8 weight is dequantized
once, at load or when an update brings one, as w = q * scale_inv block by block with the checkpoint's
`weight_block_size` (partial last blocks keep a scale of their own). transformers' own FP8 dequantization on a
host derives the block from the scale grid and refuses rows or columns that are not a multiple of it, so the
engine reads these checkpoints itself: the model is built from its config, then every tensor is loaded by its
checkpoint name through the engine's WeightNameMap (weights.plan_disk_update), the FP8 ones dequantized.

Checked before anything is read: an FP8 weight without its scale, a scale without its FP8 weight, a scale grid
that does not fit its weight, an FP8 weight in a module the config's `modules_to_not_convert` keeps in high
precision (an engine would serve its raw e4m3 values there), each one line naming the tensor and the fix.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from slime.backends.embedded.errors import BadRequest
from slime.utils.fp8_blocks import SCALE_SUFFIX, Fp8BlockFormat, Fp8FormatError, dequantize, scale_shape

FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


@dataclass(frozen=True)
class Fp8Layout:
    """How a checkpoint stores its block-FP8 weights: the block format and the modules left unquantized."""

    fmt: Fp8BlockFormat = Fp8BlockFormat()
    not_converted: tuple[str, ...] = ()

    @classmethod
    def of_dir(cls, model_path: str) -> "Fp8Layout | None":
        """The layout config.json states (top level or text_config); None without fp8 quantization."""
        try:
            with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            return None
        try:
            fmt = Fp8BlockFormat.from_config(config)
        except Fp8FormatError as e:
            raise BadRequest(f"{model_path}: {e}") from e
        if fmt is None:
            return None
        q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
        return cls(fmt, tuple(str(m) for m in q.get("modules_to_not_convert") or ()))

    def keeps_unquantized(self, weight_name: str) -> bool:
        """Whether the module of `weight_name` is one `modules_to_not_convert` names: a prefix ending at a module
        boundary ("model.layers.1" covers "model.layers.1.mlp", not "model.layers.11"), the same as a regex, or
        a suffix ("lm_head")."""
        module = weight_name.rpartition(".")[0]
        for entry in self.not_converted:
            if module.endswith(entry) or _matches_at_boundary(entry, module):
                return True
        return False


def _matches_at_boundary(pattern: str, module: str) -> bool:
    try:
        return re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module) is not None
    except re.error:
        return module == pattern or module.startswith(pattern + ".")


def fold_scales(specs: list[tuple[str, Any, torch.dtype]], layout: Fp8Layout,
                source: str) -> tuple[list[tuple[str, Any, torch.dtype]], dict[str, str]]:
    """(specs with each block-FP8 weight as the float32 tensor it dequantizes to and its scale dropped,
    {FP8 weight: its scale's name}). BadRequest, one line, for a malformed pair; `source` names where the
    tensors come from."""
    by_name = {n: (shape, dt) for n, shape, dt in specs}
    pairs, problems = {}, []
    for name, shape, dt in specs:
        if name.endswith(SCALE_SUFFIX):
            weight = name[: -len(SCALE_SUFFIX)]
            if weight not in by_name or by_name[weight][1] not in FLOAT8:
                problems.append(f"{name} scales no float8 weight {weight}")
            continue
        if dt not in FLOAT8:
            continue
        problems += _pair_problems(name, shape, dt, by_name.get(name + SCALE_SUFFIX), layout)
        pairs[name] = name + SCALE_SUFFIX
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise BadRequest(f"{source}: malformed block-FP8 weights: {problems[0]}{more}; re-quantize it with "
                         "slime.utils.fp8_blocks.quantize (e4m3 + float32 weight_scale_inv per "
                         f"{list(layout.fmt.block)} block)")
    folded = [(n, shape, torch.float32 if n in pairs else dt) for n, shape, dt in specs
              if not n.endswith(SCALE_SUFFIX)]
    return folded, pairs


def _pair_problems(name: str, shape: Any, dt: torch.dtype, scale: tuple[Any, torch.dtype] | None,
                   layout: Fp8Layout) -> list[str]:
    if scale is None:
        return [f"{name} is float8 without its {name + SCALE_SUFFIX}"]
    if dt != layout.fmt.dtype:
        return [f"{name} is {str(dt).removeprefix('torch.')}, block FP8 here is e4m3 (float8_e4m3fn)"]
    if len(shape) < 2:
        return [f"{name} has shape {list(shape)}; a block-FP8 weight has at least 2 dimensions"]
    want = scale_shape(tuple(int(s) for s in shape), layout.fmt.block)
    got = tuple(int(s) for s in scale[0])
    if got != want:
        return [f"{name + SCALE_SUFFIX} has shape {list(got)}, a {list(shape)} weight in "
                f"{list(layout.fmt.block)} blocks needs {list(want)}"]
    if not scale[1].is_floating_point or scale[1] in FLOAT8:
        return [f"{name + SCALE_SUFFIX} is {str(scale[1]).removeprefix('torch.')}, not a float32 scale"]
    if layout.keeps_unquantized(name):
        return [f"{name} is float8, but quantization_config.modules_to_not_convert keeps its module unquantized"]
    return []


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
