"""Upstream slime's `slime.observability.rollout_data_utils`: rollout data made into CPU tensors for training,
checks of routed-experts captures (R3) and of compact-rollout ids, and the debug rollout files, the last over
this project's slime.rollout.debug_data (same file format; read back with weights_only=True)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from slime.rollout import debug_data
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

# Per-sample list fields and the dtype each becomes (None: keep the value's own dtype), as upstream casts them.
ROLLOUT_TENSOR_DTYPES: dict[str, torch.dtype | None] = {
    "tokens": torch.long,
    "loss_masks": torch.int,
    "rollout_log_probs": torch.float32,
    "rollout_top_p_token_ids": torch.int32,
    "rollout_top_p_token_offsets": torch.int32,
    "teacher_log_probs": torch.float32,
    "rollout_routed_experts": None,
}


def _as_cpu_tensor(value: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    if isinstance(value, np.ndarray) and not value.flags.writeable:
        value = value.copy()  # torch refuses to share memory with a read-only array
    tensor = torch.as_tensor(value) if dtype is None else torch.as_tensor(value, dtype=dtype)
    return tensor.detach().cpu().contiguous()


def tensorize_rollout_data_for_training(rollout_data: dict[str, Any]) -> None:
    """In place: each per-sample list field becomes a list of contiguous CPU tensors of its training dtype;
    arrays inside multimodal_train_inputs become tensors; rollout_mask_sums becomes one float32 tensor."""
    for key, dtype in ROLLOUT_TENSOR_DTYPES.items():
        if key in rollout_data:
            rollout_data[key] = [_as_cpu_tensor(value, dtype) for value in rollout_data[key]]
    if "multimodal_train_inputs" in rollout_data:
        rollout_data["multimodal_train_inputs"] = [
            None if inputs is None else {
                k: _as_cpu_tensor(v) if isinstance(v, (np.ndarray, torch.Tensor)) else v for k, v in inputs.items()}
            for inputs in rollout_data["multimodal_train_inputs"]]
    if "rollout_mask_sums" in rollout_data:
        rollout_data["rollout_mask_sums"] = _as_cpu_tensor(rollout_data["rollout_mask_sums"], torch.float32)


def _moe_layers(args: Any, num_layers: int) -> list[int]:
    # Upstream reads an absent --moe-layer-freq as "every layer is MoE"; a namespace built by a plugin may lack it.
    layer_freq = vars(args).get("moe_layer_freq") if hasattr(args, "__dict__") else None
    if isinstance(layer_freq, (list, tuple)):
        return [i for i, freq in enumerate(layer_freq[:num_layers]) if int(freq) != 0]
    return list(range(num_layers))


def validate_rollout_routed_experts_for_replay(routed_experts: list[torch.Tensor], args: Any) -> None:
    """ValueError unless every sample's capture is (tokens >= 1, num_layers, moe_router_topk) and, for top-k > 1,
    no MoE layer's capture is all zero (pipeline stages whose disjoint captures were not merged)."""
    if not routed_experts:
        raise ValueError("R3 is enabled but no rollout routed-experts tensors were returned.")
    num_layers, topk = int(args.num_layers), int(args.moe_router_topk)
    moe_layers = _moe_layers(args, num_layers)
    for index, experts in enumerate(routed_experts):
        experts = torch.as_tensor(experts)
        if experts.ndim != 3 or tuple(experts.shape[1:]) != (num_layers, topk):
            raise ValueError(f"Invalid rollout routed-experts shape for R3: sample={index}, "
                             f"got={tuple(experts.shape)}, expected=(*, {num_layers}, {topk}).")
        if experts.shape[0] == 0:
            raise ValueError(f"R3 sample {index} has no routed-experts rows.")
        if topk > 1:
            empty = [layer for layer in moe_layers if not torch.count_nonzero(experts[:, layer, :])]
            if empty:
                raise ValueError(f"R3 routed-experts capture is all zero for MoE layers {empty} in sample {index}: "
                                 "the engine's pipeline stages' captures were not merged; refusing to replay "
                                 "expert 0 everywhere.")


def validate_rollout_id_annotated(node: Any, depth: int = 0) -> None:
    """AssertionError when a compact rollout (a list of Samples at nesting depth >= 2: prompt x rollout x the
    samples one execution produced) has more than one sample and they do not all carry the same rollout_id;
    the usual list[list[Sample]] is not checked."""
    if isinstance(node, Sample):
        return
    assert isinstance(node, list), f"unexpected rollout output node type: {type(node).__name__}"
    if node and isinstance(node[0], Sample):
        if depth >= 2 and len(node) > 1:
            ids = [sample.rollout_id for sample in node]
            unset = [i for i, rollout_id in enumerate(ids) if rollout_id is None]
            assert not unset, (f"Compact rollout returned {len(node)} samples but rollout_id is unset on positions "
                               f"{unset}: set Sample.rollout_id on every sample of one execution.")
            assert len(set(ids)) == 1, f"Sibling samples from one compact rollout must share rollout_id; got {ids}."
        return
    for child in node:
        validate_rollout_id_annotated(child, depth + 1)


def load_debug_rollout_data(path_template: str, *, rollout_id: int, subsample_ratio: float | None = None
                            ) -> list[Sample]:
    """The samples saved for `rollout_id`; `subsample_ratio` keeps int(n * ratio) of them, half from each end
    (upstream's slicing: a ratio that rounds to no sample keeps them all)."""
    samples = debug_data.load_rollout(path_template, rollout_id)
    if subsample_ratio is None:
        return samples
    keep = int(len(samples) * subsample_ratio)
    head, tail = samples[:keep // 2], samples[-keep // 2:]  # -keep // 2 == -ceil(keep / 2); 0 takes everything
    logger.info("subsample ratio %s: %d -> %d debug rollout samples", subsample_ratio, len(samples),
                len(head) + len(tail))
    return head + tail


def save_debug_rollout_data(path_template: str | None, data: Any, *, rollout_id: int, evaluation: bool) -> None:
    """A rollout's samples (a list) or an evaluation's ({name: {"samples": [...]}}, saved as eval_<id>);
    nothing when `path_template` is None."""
    if evaluation:
        debug_data.save_eval(path_template, data, rollout_id)
    else:
        debug_data.save_rollout(path_template, data, rollout_id)
