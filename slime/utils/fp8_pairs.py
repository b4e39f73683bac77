"""Which block-FP8 weight goes with which scale, checked: the one pairing that the trainer's HF reader
(slime/backends/megatron/hf_io.py) and the embedded engine (checkpoints and weight updates,
slime/backends/embedded/fp8_checkpoint.py) both use, so a tensor set that one side accepts is never refused by
the other (the format itself: fp8_blocks.py).

The pairing works on names, shapes and dtypes only (a safetensors header, an update's specs), so a malformed set
is refused before any tensor is read or any weight changes. Refused, each in one line naming the tensor:
- a float8 weight without its `X.weight_scale_inv` (it cannot be dequantized);
- a scale whose weight is missing or not float8 (an orphan: a reader would drop it silently);
- a float8 weight that is not e4m3 or has fewer than 2 dimensions;
- a scale grid other than the weight's leading dimensions and ceil(rows / block) x ceil(cols / block);
- a scale that is not a high-precision float;
- a float8 weight in a module that quantization_config.modules_to_not_convert keeps unquantized (an FP8
  engine would serve its raw e4m3 values there).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from slime.utils.fp8_blocks import SCALE_SUFFIX, Fp8BlockFormat, Fp8FormatError, scale_shape

FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))

Spec = tuple[str, Any, torch.dtype]  # (name, shape, dtype)


@dataclass(frozen=True)
class Fp8Layout:
    """How a checkpoint stores its block-FP8 weights: the block format and the modules left unquantized."""

    fmt: Fp8BlockFormat = Fp8BlockFormat()
    not_converted: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Fp8Layout | None":
        """The layout a config.json states (top level or text_config); None without fp8 quantization;
        Fp8FormatError for a format that is not read."""
        fmt = Fp8BlockFormat.from_config(config)
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


# safetensors' dtype codes; a dtype this torch lacks pairs as uint8 (never float8, never a float scale)
STORED_DTYPES = {code: getattr(torch, name) for code, name in (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"), ("I64", "int64"), ("I32", "int32"), ("I16", "int16"), ("I8", "int8"),
    ("U8", "uint8"), ("BOOL", "bool")) if hasattr(torch, name)}


def stored_specs(path: str) -> list[Spec]:
    """(name, shape, dtype) of every tensor of a safetensors file, from its header alone: what pair_scales
    checks before any tensor is read."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        slices = [(name, f.get_slice(name)) for name in f.keys()]
        return [(name, sl.get_shape(), STORED_DTYPES.get(sl.get_dtype(), torch.uint8)) for name, sl in slices]


def pair_scales(specs: Iterable[Spec], layout: Fp8Layout) -> dict[str, str]:
    """{float8 weight: its scale's name} of a tensor set; Fp8FormatError, one line naming the first malformed
    tensor (and how many more) and the fix, when any weight or scale breaks the rules above."""
    specs = list(specs)
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
        raise Fp8FormatError(f"malformed block-FP8 weights: {problems[0]}{more}; re-quantize it with "
                             "slime.utils.fp8_blocks.quantize (e4m3 + float32 weight_scale_inv per "
                             f"{list(layout.fmt.block)} block)")
    return pairs


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
