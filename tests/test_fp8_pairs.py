"""One block-FP8 pairing (slime/utils/fp8_pairs.py) for the trainer's HF reader (hf_io.HFCheckpoint) and the
embedded engine (fp8_checkpoint.fold_scales, used on checkpoints and on weight updates): on the same tensors both
accept the same pairs, or both refuse in one line with the same words, before any tensor is read. The tensor set
is a header-only synthetic one (no model): a [40, 50] e4m3 weight in [16, 24] blocks (partial blocks both ways,
a 3 x 3 scale grid), a 3-D fused expert tensor with a per-expert grid, and high-precision tensors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from slime.utils.fp8_blocks import quantize, scale_name

BLOCK = (16, 24)
W = "model.layers.0.mlp.up_proj.weight"
FUSED = "model.layers.0.mlp.experts.gate_up_proj"
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK), "modules_to_not_convert": ["lm_head"]}


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    w, fused = torch.randn(40, 50, generator=g), torch.randn(2, 40, 30, generator=g)
    out = {"model.norm.weight": torch.ones(50), "lm_head.weight": torch.randn(7, 50, generator=g)}
    for name, t in ((W, w), (FUSED, fused)):
        out[name], out[scale_name(name)] = quantize(t, BLOCK)
    return out


def _edit(case: str, t: dict[str, torch.Tensor]) -> str:
    """Break `t` as `case` says; returns the words both readers must refuse it with."""
    if case == "missing_scale":
        del t[scale_name(W)]
        return f"{W} is float8 without its {scale_name(W)}"
    if case == "scale_shape":
        t[scale_name(W)] = t[scale_name(W)][:2]
        return f"{scale_name(W)} has shape [2, 3], a [40, 50] weight in [16, 24] blocks needs [3, 3]"
    if case == "fused_scale_shape":  # one grid for both experts instead of one per expert
        t[scale_name(FUSED)] = t[scale_name(FUSED)][0]
        return f"{scale_name(FUSED)} has shape [3, 2], a [2, 40, 30] weight in [16, 24] blocks needs [2, 3, 2]"
    if case == "orphan_scale":
        t["model.norm.weight_scale_inv"] = torch.ones(1, 3)
        return "model.norm.weight_scale_inv scales no float8 weight model.norm.weight"
    if case == "e5m2":
        t[W] = t[W].float().to(torch.float8_e5m2)
        return f"{W} is float8_e5m2, block FP8 here is e4m3"
    if case == "integer_scale":
        t[scale_name(W)] = t[scale_name(W)].to(torch.int32)
        return f"{scale_name(W)} is int32, not a float32 scale"
    if case == "unconverted_module":
        t["lm_head.weight"], t["lm_head.weight_scale_inv"] = quantize(t["lm_head.weight"], BLOCK)
        return "lm_head.weight is float8, but quantization_config.modules_to_not_convert keeps its module unquantized"
    raise AssertionError(case)


def _write(path, tensors) -> str:
    os.makedirs(path)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "glm5_next", "quantization_config": QUANT}, f)
    return str(path)


def _engine_pairs(path: str, tensors: dict[str, torch.Tensor]):
    from slime.backends.embedded.fp8_checkpoint import fold_scales, layout_of_dir

    return fold_scales([(n, t.shape, t.dtype) for n, t in tensors.items()], layout_of_dir(path), path)


def test_both_readers_pair_a_well_formed_set_alike(tmp_path):
    from slime.backends.megatron.hf_io import HFCheckpoint

    tensors = _tensors()
    path = _write(tmp_path / "ok", tensors)
    folded, pairs = _engine_pairs(path, tensors)
    ckpt = HFCheckpoint(path)
    assert pairs == {W: scale_name(W), FUSED: scale_name(FUSED)}
    assert {n for n, _, _ in folded} == {n for n in tensors if not n.endswith("_scale_inv")}
    fused_parts = {f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in (0, 1) for p in ("gate", "up")}
    assert set(ckpt.fp8_weights()) == {W} | fused_parts  # the fused tensor under its per-expert names
    assert not any(n.endswith("_scale_inv") for n in ckpt.names())
    assert ckpt.get(W).dtype == torch.float32 and ckpt.get(W).shape == (40, 50)


@pytest.mark.parametrize("case", ["missing_scale", "scale_shape", "fused_scale_shape", "orphan_scale", "e5m2",
                                  "integer_scale", "unconverted_module"])
def test_both_readers_refuse_a_malformed_pair_in_the_same_line(tmp_path, case):
    from slime.backends.embedded.errors import BadRequest
    from slime.backends.megatron.hf_io import HFCheckpoint, HFCheckpointError

    tensors = _tensors()
    words = _edit(case, tensors)
    path = _write(tmp_path / case, tensors)
    with pytest.raises(HFCheckpointError) as trainer:
        HFCheckpoint(path)
    with pytest.raises(BadRequest) as engine:
        _engine_pairs(path, tensors)
    for e in (trainer, engine):
        message = str(e.value)
        assert message.startswith(f"{path}: malformed block-FP8 weights: {words}"), message
        assert "\n" not in message and "re-quantize it with slime.utils.fp8_blocks.quantize" in message
    assert str(trainer.value) == str(engine.value)


def test_stored_specs_read_every_dtype_from_the_header(tmp_path):
    """stored_specs (the pairing's input for tools reading shards, tools/fp8_cast_bf16.py): names, shapes and
    dtypes as stored, float8 included, without reading tensor data."""
    from slime.utils.fp8_pairs import stored_specs

    tensors = {**_tensors(), "ids": torch.arange(5, dtype=torch.int32), "mask": torch.ones(2, 3, dtype=torch.bool),
               "half": torch.zeros(4, dtype=torch.bfloat16)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    assert sorted(stored_specs(str(path))) == sorted((n, list(t.shape), t.dtype) for n, t in tensors.items())
