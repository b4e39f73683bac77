"""transformers patch set, the same on every accelerator (cpu, cuda, npu): the DSA indexers of GLM-5 and
GLM-5.3-Flash keep their top-k keys (pools) by slime's tie rule.

`GlmMoeDsaIndexer.forward` ends in `index_scores.topk(...)`. Index scores tie exactly whenever several
keys have all their ReLU terms at 0, and torch.topk breaks such ties by tensor shape and kernel: the
embedded engine's cached decode step (one query row) and a full-sequence forward (re-prefill, and the
trainer's `ops.lightning_indexer`) then keep different keys, and the rollout log-probs drift from the
trainer's (up to 8e-2 on the tiny GLM-5 at index_topk=8). The patch runs transformers' forward unchanged
and answers only its top-k with `ops.reference.stable_topk` (ties -> lowest key position), the rule of
`ops.lightning_indexer`. The embedded engine applies it before building its model. GLM-5.3-Flash's
`Glm5NextTextIndexer.forward` (transformers 5.24+) ends the same way over its k-pool scores, whole pools tying
when all their ReLU terms are 0; the same patch gives it `ops.kpool_indexer`'s rule (lowest pool first).

On CPU, GLM-5.3-Flash's KDA prefill runs transformers' torch fallback `chunk_kimi_delta_attention` (fla is a
Triton kernel), which pads every sequence to one 64-token chunk and loops over its 63 rows; the quick start's
prompts are 8-14 tokens, so a prefill cost 9x what a 16-token chunk costs (0.60 -> 0.07 s CPU for 64 prompts of
8 tokens). `glm5_next_kda_fitted_chunk` gives the fallback the smallest chunk of 16, 32 or 64 tokens that holds
the sequence: the chunked delta rule is exact for any chunk size, so only float rounding can change.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from slime.accelerator.ops.reference import stable_topk
from slime.accelerator.patches import Patch, register_patch

TRANSFORMERS_VERSIONS = ">=5.2,<6"
INDEXER_FORWARD = "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa:GlmMoeDsaIndexer.forward"
KPOOL_INDEXER_VERSIONS = ">=5.24,<6"  # glm5_next first ships in transformers 5.24
KPOOL_INDEXER_FORWARD = "transformers.models.glm5_next.modeling_glm5_next:Glm5NextTextIndexer.forward"
KDA_CHUNK_FUNCTION = "transformers.models.glm5_next.modeling_glm5_next:chunk_kimi_delta_attention"
KDA_CHUNK_SIZES = (16, 32, 64)  # 64: transformers' default, the largest chunk the fallback is given


def _stable_topk_result(input: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True,
                        *, out: Any = None):
    if out is not None:
        raise TypeError("topk(out=...) is not supported inside StableTopk")
    values, indices = stable_topk(input, int(k), dim, largest)  # sorted either way: valid for sorted=False
    return torch.return_types.topk((values, indices))


class StableTopk(TorchFunctionMode):
    """Inside the block (this thread only), `torch.topk` / `Tensor.topk` break ties by lowest position;
    every other torch call runs as is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.topk or func is torch.topk:
            return _stable_topk_result(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _indexer_forward(original: Callable | None) -> Callable:
    if original is None:
        raise RuntimeError(f"the DSA indexer's forward ({INDEXER_FORWARD} / {KPOOL_INDEXER_FORWARD}) not found; "
                           f"this transformers is outside the patch's versions")
    if getattr(original, "slime_stable_topk", False):  # the set of another accelerator name already wraps it
        return original

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        with StableTopk():
            return original(self, *args, **kwargs)

    forward.slime_stable_topk = True
    return forward


PATCHES = [
    Patch(
        name="glm_moe_dsa_indexer_stable_topk",
        targets=(INDEXER_FORWARD,),
        replacement=_indexer_forward,
        why="exact index-score ties (all-ReLU-zero keys) at the top-k cut are broken differently by torch.topk in "
            "a one-row decode step and a full forward, so the engine's log-probs disagree with the trainer's",
        replaces="GlmMoeDsaIndexer.forward: same computation, but its final topk keeps the lowest key position "
                 "among equal scores (ops.reference.stable_topk), as slime's ops.lightning_indexer does",
        versions=TRANSFORMERS_VERSIONS,
        remove_when="transformers' indexer selects with a shape-independent tie order that matches "
                    "ops.lightning_indexer (or the engine stops running transformers' GLM-5 modules)",
    ),
]
KPOOL_PATCH = Patch(
    name="glm5_next_indexer_stable_topk",
    targets=(KPOOL_INDEXER_FORWARD,),
    replacement=_indexer_forward,
    why="exact pool-score ties (whole k-pools whose ReLU terms are all 0) at the top-k cut are broken differently by "
        "torch.topk in a one-row decode step and a full forward, and differently from the trainer's "
        "ops.kpool_indexer, so the engine's GLM-5.3-Flash log-probs disagree with the trainer's",
    replaces="Glm5NextTextIndexer.forward: same computation, but its final topk over the pools keeps the lowest pool "
             "among equal scores (ops.reference.stable_topk), as slime's ops.kpool_indexer does",
    versions=KPOOL_INDEXER_VERSIONS,
    remove_when="transformers' k-pool indexer selects with a shape-independent tie order that matches "
                "ops.kpool_indexer (or the engine stops running transformers' GLM-5.3-Flash modules)",
)


def fitted_chunk_size(sequence_length: int) -> int:
    """The smallest of KDA_CHUNK_SIZES that holds `sequence_length` tokens (the largest for longer sequences)."""
    return next((c for c in KDA_CHUNK_SIZES if sequence_length <= c), KDA_CHUNK_SIZES[-1])


def _kda_fitted_chunk(original: Callable | None) -> Callable:
    if original is None:
        raise RuntimeError(f"{KDA_CHUNK_FUNCTION} not found; this transformers is outside the patch's versions")
    if getattr(original, "slime_fitted_chunk", False):
        return original

    @functools.wraps(original)
    def chunk_kimi_delta_attention(*args, **kwargs):
        # transformers calls it as (query, key, value, g=, beta=, ...) with query [batch, tokens, heads, dim]
        if len(args) <= 5 and "chunk_size" not in kwargs:
            query = args[0] if args else kwargs["query"]
            kwargs["chunk_size"] = fitted_chunk_size(query.shape[1])
        return original(*args, **kwargs)

    chunk_kimi_delta_attention.slime_fitted_chunk = True
    return chunk_kimi_delta_attention


KDA_CHUNK_PATCH = Patch(
    name="glm5_next_kda_fitted_chunk",
    targets=(KDA_CHUNK_FUNCTION,),
    replacement=_kda_fitted_chunk,
    why="transformers' torch KDA (the fallback that runs on CPU) pads every prefill to a 64-token chunk; the "
        "embedded engine's short prompts then cost up to 9x their work (quick start: 0.60 vs 0.07 s CPU a prefill)",
    replaces="chunk_kimi_delta_attention called without chunk_size: the same function with the smallest chunk of "
             "16 / 32 / 64 tokens that holds the sequence (64 beyond); exact up to float rounding",
    versions=KPOOL_INDEXER_VERSIONS,
    remove_when="the CPU engine runs a KDA kernel that does not pad short sequences (or stops running "
                "transformers' GLM-5.3-Flash modules)",
)


def register(accelerator: str) -> None:
    """Register the set for `accelerator` (a lazy patch loader calls this on first apply_patches)."""
    for patch in PATCHES:
        register_patch(accelerator, "transformers", patch)
    if importlib.util.find_spec("transformers.models.glm5_next") is not None:  # transformers 5.24+ only
        register_patch(accelerator, "transformers", KPOOL_PATCH)
        if accelerator == "cpu":  # a device runs fla's kernel, which takes no chunk size
            register_patch(accelerator, "transformers", KDA_CHUNK_PATCH)
