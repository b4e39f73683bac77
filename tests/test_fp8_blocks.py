"""Block-FP8 checkpoints (GLM-5.3-Flash's e4m3 experts with a weight_scale_inv per [128, 128] block): dequantized
reads against a float64 dequantization (rows / columns that are not a multiple of the block, 3-D fused experts,
gate and up projections an engine merges), --hf-checkpoint loading and export of a tiny synthetic FP8
checkpoint, and re-quantization in the checkpoint's format (round trip).

Tolerances: a float32 dequantization is one rounding of an exact product (e4m3 x float32 scale), so it equals
the float64 one to a relative 2^-24; e4m3 keeps 3 mantissa bits, so quantizing rounds each value to within half
an e4m3 step: 2^-4 relative for normal values, 2^-10 x the block's scale below e4m3's normal range."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from slime.utils.fp8_blocks import (E4M3_MAX, Fp8BlockFormat, Fp8FormatError, dequantize, quantize, quantize_named,
                                    scale_name, scale_shape)


def _reference(q: torch.Tensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    """float64, block by block."""
    out = torch.empty(q.shape, dtype=torch.float64)
    rows, cols = q.shape[-2:]
    for i in range(scale_inv.shape[-2]):
        for j in range(scale_inv.shape[-1]):
            r, c = slice(i * block[0], min((i + 1) * block[0], rows)), slice(j * block[1], min((j + 1) * block[1], cols))
            out[..., r, c] = q[..., r, c].double() * scale_inv[..., i, j].double()[..., None, None]
    return out


def _random_fp8(shape, block, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(shape, generator=g) * 100).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    scale = torch.rand(scale_shape(shape, block), generator=g) * 1e-2 + 1e-4
    return q, scale


def _within_e4m3(deq: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block) -> None:
    s = scale_inv.double().repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :w.shape[-2], :w.shape[-1]]
    err = (deq.double() - w.double()).abs()
    assert bool((err <= w.double().abs() * 2**-4 + s * 2**-10).all()), float((err - w.double().abs() * 2**-4).max())


@pytest.mark.parametrize("shape,block", [((576, 300), (128, 128)), ((128, 256), (128, 128)), ((3, 200, 130), (128, 128)),
                                         ((40, 7), (16, 24)), ((1, 1), (128, 128))])
def test_dequantize_equals_float64_reference(shape, block):
    q, scale = _random_fp8(shape, block, seed=sum(shape))
    out = dequantize(q, scale, block)
    ref = _reference(q, scale, block)
    assert out.dtype == torch.float32 and out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, rtol=2**-24, atol=0)
    assert torch.equal(dequantize(q, scale, block, dtype=torch.float64), ref)  # float64 path: exact
    assert dequantize(q, scale, block, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_scale_grid_mismatch_is_one_line():
    q, scale = _random_fp8((576, 300), (128, 128), seed=1)
    with pytest.raises(Fp8FormatError, match=r"experts.0.gate_proj.weight_scale_inv has shape \(4, 3\), "
                                             r"but a \(576, 300\) weight in \[128, 128\] blocks needs \(5, 3\)"):
        dequantize(q, scale[:4], name="experts.0.gate_proj.weight")  # the lost last (partial) scale row


@pytest.mark.parametrize("shape,block", [((576, 300), (128, 128)), ((2, 130, 257), (128, 128)), ((33, 50), (16, 24))])
def test_quantize_round_trip(shape, block):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(shape, generator=g, dtype=torch.float64) * torch.logspace(-3, 1, shape[-1], dtype=torch.float64)
    w[..., :block[0], :block[1]] = 0  # an all-zero block dequantizes to zeros
    q, scale = quantize(w, block)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == scale_shape(shape, block)
    assert torch.equal(scale[..., 0, 0], torch.ones_like(scale[..., 0, 0]))
    deq = dequantize(q, scale, block, dtype=torch.float64)
    assert torch.equal(deq[..., :block[0], :block[1]], torch.zeros_like(deq[..., :block[0], :block[1]]))
    _within_e4m3(deq, w, scale, block)
    # every block uses e4m3's range: its largest value lands at (or one rounding from) 448
    amax = q.double().abs().reshape(-1).max()
    assert amax == E4M3_MAX
    # re-quantizing a checkpoint's dequantized values gives the same weights back (to one e4m3 rounding)
    q2, scale2 = quantize(deq, block)
    torch.testing.assert_close(scale2, scale, rtol=2**-20, atol=0)
    _within_e4m3(dequantize(q2, scale2, block, dtype=torch.float64), deq, scale2, block)
    assert (q2.view(torch.uint8) == q.view(torch.uint8)).double().mean() > 0.99


def test_merged_gate_up_keep_one_scale_grid_per_checkpoint_tensor():
    """An engine merges gate_proj and up_proj [576, H] into one [1152, H] weight: sent per checkpoint tensor,
    each keeps its 5 scale rows (10 together); quantized merged there would be 9, the last gate block sharing a
    scale with the first up rows."""
    g = torch.Generator().manual_seed(3)
    gate, up = torch.randn(576, 300, generator=g), torch.randn(576, 300, generator=g) * 50
    named = [("mlp.gate_proj.weight", gate), ("mlp.up_proj.weight", up), ("mlp.gate.weight", torch.randn(8, 300))]
    sent = dict(quantize_named(named, {"mlp.gate_proj.weight", "mlp.up_proj.weight"}))
    assert list(sent) == ["mlp.gate_proj.weight", "mlp.gate_proj.weight_scale_inv", "mlp.up_proj.weight",
                          "mlp.up_proj.weight_scale_inv", "mlp.gate.weight"]
    assert sent["mlp.gate.weight"] is named[2][1]  # not FP8 in the checkpoint: unchanged
    rows = [sent[scale_name(f"mlp.{p}_proj.weight")].shape[0] for p in ("gate", "up")]
    assert rows == [5, 5] and scale_shape((1152, 300))[0] == 9
    merged = torch.cat([dequantize(sent[f"mlp.{p}_proj.weight"], sent[scale_name(f"mlp.{p}_proj.weight")],
                                   dtype=torch.float64) for p in ("gate", "up")])
    for part, w in ((merged[:576], gate), (merged[576:], up)):
        _within_e4m3(part, w, quantize(w)[1], (128, 128))
    # quantized as one merged tensor, the small gate rows 512..575 share a block scale with up's large rows 0..63
    _, merged_scale = quantize(torch.cat([gate, up]))
    assert merged_scale[4, 0] > 10 * sent["mlp.gate_proj.weight_scale_inv"][4, 0]


def test_format_from_config():
    cfg = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128]}}
    assert Fp8BlockFormat.from_config(cfg) == Fp8BlockFormat((128, 128))
    assert Fp8BlockFormat.from_config({"text_config": cfg}).block == (128, 128)
    assert Fp8BlockFormat.from_config({}) is None
    with pytest.raises(Fp8FormatError, match="only e4m3"):
        Fp8BlockFormat.from_config({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}})


# --- the HF reader, --hf-checkpoint loading and export --------------------------------------------------------
BLOCK = (16, 24)  # the tiny model's experts are [32, 64] / [64, 32]: partial blocks in both dimensions
FP8_PARTS = (".mlp.experts.", ".mlp.shared_experts.")  # as the published checkpoint: routed and shared experts


def _fp8_copy(src: str, fp8_dir: str, ref_dir: str) -> dict[str, torch.Tensor]:
    """Two copies of a float32 checkpoint: experts in block FP8 (+ quantization_config), and the same weights
    as float32 (the float64 dequantization rounded once). Returns the float64 dequantized experts."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    cfg = json.load(open(os.path.join(src, "config.json")))
    fp8, ref, expected = {}, {}, {}
    for name, t in tensors.items():
        if any(p in name for p in FP8_PARTS):
            q, s = quantize(t, BLOCK)
            fp8[name], fp8[scale_name(name)] = q, s
            expected[name] = _reference(q, s, BLOCK)
            ref[name] = expected[name].float()
        else:
            fp8[name] = ref[name] = t
    for d, ts, qc in ((fp8_dir, fp8, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": list(BLOCK)}), (ref_dir, ref, None)):
        os.makedirs(d)
        save_file(ts, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        json.dump(cfg | ({"quantization_config": qc} if qc else {}), open(os.path.join(d, "config.json"), "w"))
    return expected


def test_hf_reader_dequantizes_fp8_tensors(tmp_path):
    from glm5_helpers import write_checkpoint

    from slime.backends.megatron.hf_io import HFCheckpoint, HFCheckpointError

    src = write_checkpoint(tmp_path / "src", "glm_moe_dsa", seed=5)
    expected = _fp8_copy(src, str(tmp_path / "fp8"), str(tmp_path / "ref"))
    ckpt, ref = HFCheckpoint(str(tmp_path / "fp8")), HFCheckpoint(str(tmp_path / "ref"))
    assert ckpt.names() == ref.names() and not any(n.endswith("_scale_inv") for n in ckpt.names())
    assert set(ckpt.fp8_weights()) == set(expected) and set(ckpt.fp8_weights().values()) == {BLOCK}
    for name, want in expected.items():
        got = ckpt.get(name)
        assert got.dtype == torch.float32 and ckpt.tensor_dtype(name) is None
        torch.testing.assert_close(got.double(), want, rtol=2**-24, atol=0)
    # a scale grid that does not fit its weight: one line naming the tensor
    tensors = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    name = next(iter(expected))
    tensors[scale_name(name)] = tensors[scale_name(name)][:-1]
    save_file(tensors, str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match=f"{name}_scale_inv has shape"):
        HFCheckpoint(str(tmp_path / "fp8")).get(name)
    del tensors[scale_name(name)]
    save_file(tensors, str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match=f"{name} is float8 without its {name}_scale_inv"):
        HFCheckpoint(str(tmp_path / "fp8"))


def test_fused_fp8_experts_split_after_dequantizing(tmp_path):
    """transformers 5's fused gate_up_proj [E, 2I, H] in FP8 with a [E, ceil(2I/b), ceil(H/b)] grid: each expert's
    gate and up halves are its dequantized rows, even where a block straddles the two halves (I = 20, b = 16)."""
    from slime.backends.megatron.hf_io import HFCheckpoint

    q, s = _random_fp8((3, 40, 50), BLOCK, seed=9)
    os.makedirs(tmp_path / "f")
    save_file({"model.layers.1.mlp.experts.gate_up_proj": q, "model.layers.1.mlp.experts.gate_up_proj_scale_inv": s},
              str(tmp_path / "f" / "model.safetensors"))
    json.dump({"model_type": "glm_moe_dsa", "quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 24]}},
              open(tmp_path / "f" / "config.json", "w"))
    ckpt, ref = HFCheckpoint(str(tmp_path / "f")), _reference(q, s, BLOCK)
    assert ckpt.names() == {f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in range(3) for p in ("gate", "up")}
    assert set(ckpt.fp8_weights()) == ckpt.names()
    for e in range(3):
        torch.testing.assert_close(ckpt.get(f"model.layers.1.mlp.experts.{e}.gate_proj.weight").double(), ref[e, :20],
                                   rtol=2**-24, atol=0)
        torch.testing.assert_close(ckpt.get(f"model.layers.1.mlp.experts.{e}.up_proj.weight").double(), ref[e, 20:],
                                   rtol=2**-24, atol=0)


def test_load_hf_model_and_save_hf_on_an_fp8_checkpoint(tmp_path):
    """--hf-checkpoint's loader gives the model it gives for the float32 copy of the dequantized weights, bit for
    bit; save_hf writes them dequantized, with no quantization_config; the FP8 names are recorded for an FP8
    engine, and re-quantizing the exported experts reproduces the checkpoint's values within one e4m3 rounding."""
    from glm5_helpers import write_checkpoint

    from slime.backends.megatron import export_hf, load_hf_model, save_hf

    src = write_checkpoint(tmp_path / "src", "glm_moe_dsa", seed=6)
    expected = _fp8_copy(src, str(tmp_path / "fp8"), str(tmp_path / "ref"))
    model, ref = load_hf_model(str(tmp_path / "fp8")), load_hf_model(str(tmp_path / "ref"))
    ours, theirs = model.state_dict(), ref.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours if not k.endswith("_extra_state"))
    assert set(model.hf_fp8) == set(expected)
    exported = {n: t for bucket in export_hf(model) for n, t in bucket}
    sent = dict(quantize_named(exported.items(), set(model.hf_fp8), Fp8BlockFormat(BLOCK)))
    for name, want in expected.items():
        assert torch.equal(exported[name], want.float())  # the float64 value, rounded once
        _within_e4m3(dequantize(sent[name], sent[scale_name(name)], BLOCK, dtype=torch.float64), want,
                     sent[scale_name(name)], BLOCK)
    out = save_hf(model, str(tmp_path / "out"))
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert "quantization_config" not in cfg
    written = load_file(os.path.join(out, "model.safetensors"))
    assert not any(n.endswith("_scale_inv") for n in written)
    assert all(torch.equal(written[n], want.float()) for n, want in expected.items())


def test_weight_sync_sends_sglang_the_checkpoints_fp8_format(tmp_path):
    """SGLang serves --hf-checkpoint as stored: the weights it holds in block FP8 are sent re-quantized in that
    format (e4m3 + weight_scale_inv, each tensor's own grid), everything else unchanged; a checkpoint whose
    config.json states no fp8 has none (its shards are not opened)."""
    from glm5_helpers import write_checkpoint

    from slime.backends.megatron.hf_io import fp8_weights_of
    from slime.backends.megatron.weight_sync.factory import in_checkpoint_format

    src = write_checkpoint(tmp_path / "src", "glm_moe_dsa", seed=8)
    expected = _fp8_copy(src, str(tmp_path / "fp8"), str(tmp_path / "ref"))
    assert fp8_weights_of(str(tmp_path / "ref")) == {}
    os.remove(tmp_path / "ref" / "model.safetensors")
    assert fp8_weights_of(str(tmp_path / "ref")) == {}  # config.json alone decides
    fp8 = fp8_weights_of(str(tmp_path / "fp8"))
    assert set(fp8) == set(expected) and set(fp8.values()) == {BLOCK}
    ref = load_file(os.path.join(src, "model.safetensors"))
    names = sorted(ref)
    buckets = [[(n, ref[n]) for n in names[:40]], [(n, ref[n]) for n in names[40:]]]
    sent = [dict(b) for b in in_checkpoint_format(buckets, fp8)]
    assert len(sent) == 2
    flat = {k: v for b in sent for k, v in b.items()}
    assert set(flat) == set(names) | {scale_name(n) for n in expected}
    for name in names:
        if name in expected:
            q, s = flat[name], flat[scale_name(name)]
            assert q.dtype == torch.float8_e4m3fn and s.shape == scale_shape(q.shape, BLOCK)
            assert scale_name(name) in sent[0 if name in dict(buckets[0]) else 1]  # the scale travels with its weight
            _within_e4m3(dequantize(q, s, BLOCK, dtype=torch.float64), ref[name].double(), s, BLOCK)
        else:
            assert flat[name] is ref[name]
