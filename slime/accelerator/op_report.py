"""Which implementation serves each op a model uses on this device: a device kernel or the pure-torch reference.

The op table (slime.accelerator.ops) falls back to the reference with one log line when a kernel is missing, too
old or fails its start-up probe. A fallback keeps training correct but can be many times slower and hold far more
memory (the reference attention keeps float32 scores per block), so a run prints this table once at start
(slime.config.device_kernels) and `--require-device-kernels` refuses to start when any of the model's ops would
fall back.

MODEL_OPS lists, per model family (slime_plugins.models.<family>), the ops its modules call through
`get_accelerator().ops`, plus token_log_probs, which every trainer calls. A family not listed is reported
with every op of the table.
"""

from __future__ import annotations

from dataclasses import dataclass

from slime.accelerator.ops import OP_NAMES, REFERENCE

# Ops whose pure-torch implementation is the intended one on every device (no fused kernel is worth it:
# token_log_probs is a chunked log-softmax gather); they never count as a fallback.
REFERENCE_BY_DESIGN = ("token_log_probs",)

_DENSE = ("rms_norm", "apply_rotary", "attention", "swiglu", "token_log_probs")
_MOE = ("moe_route", "moe_permute", "moe_unpermute", "grouped_matmul")
MODEL_OPS: dict[str, tuple[str, ...]] = {
    "llama": _DENSE,
    "qwen2": _DENSE,
    "qwen3": _DENSE,
    "glm4": _DENSE,
    "mimo": _DENSE,
    "qwen3_moe": _DENSE + _MOE,
    "glm4_moe": _DENSE + _MOE,
    "deepseek_v3": _DENSE + _MOE,
    "minimax_m2": _DENSE + _MOE,
    "qwen3_next": _DENSE + _MOE,
    "qwen3_5": _DENSE + _MOE,
    "glm5": _DENSE + _MOE + ("sparse_attention", "lightning_indexer"),
    # GLM-5.3-Flash: NoPE MLA (no rotary), the k-pool indexer instead of the lightning indexer, KDA layers;
    # its SwiGLU is clamped by a torch clamp before ops.swiglu, and mHC is plain torch (not in the table).
    "glm5_next": ("rms_norm", "attention", "sparse_attention", "kpool_indexer", "kda", "causal_conv1d", "kda_gate",
                  "swiglu", "token_log_probs") + _MOE,
}


# A block-FP8 checkpoint (GLM-5.3-Flash's experts): the weight sync re-quantizes those weights for the engine.
FP8_CHECKPOINT_OPS = ("fp8_block_quantize",)


def model_ops(family: str | None, fp8_checkpoint: bool = False) -> tuple[str, ...]:
    """The ops family `family` calls (every op of the table for a family not in MODEL_OPS), plus the block-FP8
    quantization when the checkpoint stores weights in block FP8."""
    ops = MODEL_OPS.get(family or "", OP_NAMES)
    return ops + tuple(o for o in FP8_CHECKPOINT_OPS if o not in ops) if fp8_checkpoint else ops


@dataclass(frozen=True)
class OpRow:
    op: str
    source: str  # what runs: a kernel's name, or "reference"

    @property
    def falls_back(self) -> bool:
        return self.source == REFERENCE and self.op not in REFERENCE_BY_DESIGN


def op_rows(table, ops: tuple[str, ...]) -> list[OpRow]:
    """One row per op of `ops` from an OpTable (get_accelerator().ops)."""
    return [OpRow(op, table.source(op)) for op in ops]


def fallbacks(rows: list[OpRow]) -> list[str]:
    return [r.op for r in rows if r.falls_back]


def format_table(device: str, family: str | None, rows: list[OpRow], has_kernels: bool = True) -> list[str]:
    """The table as printed at start: a header line, then `op  -> source` per op (a fallback says so).
    `has_kernels`: the accelerator has a kernel provider at all (the CPU has none: every op is the reference)."""
    width = max((len(r.op) for r in rows), default=0)
    lines = [f"ops on {device} for model family {family or 'unknown'} (op -> implementation):"]
    fallback = ("reference (FALLBACK: no device kernel; see the ops[...] log line for why)" if has_kernels
                else f"reference (FALLBACK: {device} has no device kernels)")
    for r in rows:
        if r.falls_back:
            what = fallback
        elif r.source == REFERENCE:
            what = "reference (by design on every device)"
        else:
            what = r.source
        lines.append(f"  {r.op.ljust(width)} -> {what}")
    return lines


def refusal(device: str, family: str | None, rows: list[OpRow]) -> str | None:
    """The one-line refusal of --require-device-kernels, or None when every op runs on a device kernel."""
    missing = fallbacks(rows)
    if not missing:
        return None
    return (f"--require-device-kernels: on {device}, model family {family or 'unknown'} would run "
            f"{', '.join(missing)} on the pure-torch reference (no device kernel); install or upgrade the "
            f"kernels named in docs/ops.md, or drop the flag to accept the fallback")
