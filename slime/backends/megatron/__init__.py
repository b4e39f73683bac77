"""Megatron-core backend: GLM-5-family model from HF checkpoints, HF export, optimizer.

    from slime.backends.megatron import load_hf_model, export_hf, save_hf, build_optimizer
    model = load_hf_model(hf_dir, tp=1, ep=1, pp=1)
    logits = model(input_ids, position_ids)            # [B, S, V], full vocab on every TP rank

Names are imported lazily: `import slime.backends.megatron.data` must not import megatron-core.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "load_hf_model": "slime.backends.megatron.hf_loader",
    "HFCheckpointError": "slime.backends.megatron.hf_loader",
    "export_hf": "slime.backends.megatron.hf_export",
    "save_hf": "slime.backends.megatron.hf_export",
    "build_optimizer": "slime.backends.megatron.optimizer",
    "init_parallel": "slime.backends.megatron.parallel",
    "apply_megatron_patches": "slime.backends.megatron.parallel",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'slime.backends.megatron' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
