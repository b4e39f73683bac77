"""What a run keeps for backward when an op runs on its pure-torch reference instead of a device kernel.

Which ops fall back (`fallback_ops`) comes from the Ascend op mappings' own tables, per SoC, for the model's family
(slime.accelerator.op_report.MODEL_OPS): no published kernel (kda_ops.NO_KERNEL: KDA; no mapping: the k-pool
indexer), a kernel built for other SoCs (kda_ops.MAPPINGS: sgl-kernel-npu's causal conv is A2/A3 only), or a device
kernel whose API page leaves the SoC out (support.DOCUMENTED_SOCS: on 950-class SoCs, aclnn-only, such a call fails
and the start-up probe keeps the reference). It is the table the run prints at start (tests/test_plan_fallbacks.py
holds the two equal under the simulator). GPU profiles plan with the CUDA image's kernels (flash-attn, fla-core).

What each fallback keeps beyond the kernel path's saved tensors (which slime/plan/memory.py already counts), in
bytes per token of one layer, from the reference implementations (measured with saved-tensor hooks by the test):
- kda (slime/accelerator/ops/kda.py, chunks of CHUNK tokens), per local head: float32 chunk terms
  25 dk + 2 dv + 2 C + 3 floats, plus per chunk the solved state products and the states entering it,
  (2 dk dv + dk^2 + dk) / C floats per token; fla's chunk_kda rebuilds all of them in its backward.
- causal_conv1d: a float32 copy of every shifted input and the pre-activation, (taps + 1) floats per channel
  (q, k and v convolutions: 2 H dk + H dv channels per rank).
- attention / sparse_attention: float32 copies of q, k, v ((2 Dqk + Dv) floats per local head), and a sequence
  below blocked_attention.SCORE_ELEMENTS_LIMIT scores keeps its float32 probabilities (and, DSA-masked, the
  masked scores): 4.25 (8.25) bytes per score; planned for the worst pack, sequences just under the limit.
- rms_norm: a float32 copy of the normalised input (the hidden-size norms and the MLA latent / KDA output norms).
moe_route's reference keeps float32 router scores the layer already counts; the k-pool indexer's output is integer
(nothing kept for backward); the KDA gate has a kernel on every SoC.
"""

from __future__ import annotations

import math

from slime.plan.layout import Layout, TrainSettings
from slime.plan.model import ModelShape

F32 = 4
ASCEND_SOCS = {"950dt": "950DT", "950pr": "950PR", "a3": "A3"}  # planner device key -> SoC of the op tables
SCORE_BYTES = {"attention": 4.25, "sparse_attention": 8.25}  # kept per score by the dense reference path


def family_of(model_type: str) -> str | None:
    from slime_plugins.models.registry import UnsupportedModelError, get_family

    try:
        return get_family(model_type).name
    except UnsupportedModelError:
        return None


def fallback_ops(device_key: str, model_type: str) -> tuple[str, ...]:
    """The ops of `model_type`'s family that run on the reference on planner device `device_key`."""
    soc = ASCEND_SOCS.get(device_key)
    if soc is None:
        return ()
    from slime.accelerator import op_report
    from slime.accelerator.ascend import kda_ops
    from slime.accelerator.ascend import ops as npu_ops
    from slime.accelerator.ascend.support import documented_on

    out = []
    for op in op_report.model_ops(family_of(model_type)):
        if op in op_report.REFERENCE_BY_DESIGN:
            continue
        if op in kda_ops.NO_KERNEL:
            out.append(op)
        elif op in kda_ops.MAPPINGS:
            if kda_ops.MAPPINGS[op].socs and soc not in kda_ops.MAPPINGS[op].socs:
                out.append(op)
        elif op in npu_ops.MAPPINGS:
            if not documented_on(npu_ops.MAPPINGS[op].kernels[0], soc):
                out.append(op)
        else:  # no Ascend mapping at all (the k-pool indexer)
            out.append(op)
    return tuple(out)


def kda_reference_floats(dk: int, dv: int, chunk: int) -> float:
    """float32 values the KDA reference keeps per token and head."""
    return 25 * dk + 2 * dv + 2 * chunk + 3 + (2 * dk * dv + dk * dk + dk) / chunk


def conv_reference_floats(channels: float, taps: int) -> float:
    return (taps + 1) * channels


def attention_reference_bytes(op: str, heads: float, dqk: int, dv: int, tokens: int) -> float:
    """Per token: float32 q/k/v copies and, for the worst pack the dense path takes, the kept scores."""
    from slime.accelerator.ops.blocked_attention import SCORE_ELEMENTS_LIMIT

    longest_dense = math.isqrt(int(SCORE_ELEMENTS_LIMIT // max(heads, 1)))
    return heads * ((2 * dqk + dv) * F32 + min(tokens, longest_dense) * SCORE_BYTES[op])


def layer_bytes(model: ModelShape, layout: Layout, ts: TrainSettings, tokens: int, linear: bool) -> float:
    """Extra bytes per token of one layer (KDA when `linear`, else MLA) for the run's fallback ops."""
    ops = set(ts.fallback_ops or ())
    seq = layout.tp if layout.sp else 1
    extra = 0.0
    if linear:
        heads, d = model.linear_num_heads / layout.tp, model.linear_head_dim
        if "kda" in ops:
            extra += heads * kda_reference_floats(d, d, _kda_chunk()) * F32
        if "causal_conv1d" in ops:
            extra += conv_reference_floats(3 * heads * d, model.linear_conv_kernel) * F32
        norm_width = heads * d
    else:
        heads = model.num_heads / layout.tp
        attn = "sparse_attention" if model.index_n_heads and "sparse_attention" in ops else (
            "attention" if "attention" in ops else None)
        if attn:
            extra += attention_reference_bytes(attn, heads, model.qk_head_dim, model.v_head_dim, tokens)
        norm_width = model.q_lora_rank + model.kv_lora_rank
    if "rms_norm" in ops:
        extra += (2 * model.hidden_size / seq + norm_width) * F32
    return extra


def _kda_chunk() -> int:
    from slime.accelerator.ops.kda import CHUNK

    return CHUNK
