"""Trainer checkpoints (upstream slime keeps the same parts in `slime/backends/megatron_utils/checkpoint.py`).

- torch_dist.py: save / load in Megatron's distributed format (`--ckpt-format torch_dist`), all or nothing;
- async_save.py: `--async-save`, the files written by a thread while training goes on;
- layout.py: what a checkpoint directory holds, without importing torch or megatron (argument checks use it);
- keys.py: torch_dist tensor names (upstream's and this project's earlier ones);
- check.py: a checkpoint's layout and keys against the model, from its `.metadata` alone (preflight);
- foreign.py: a `--load` of a checkpoint this trainer did not write (its optimizer state);
- legacy.py: the former per-rank checkpoints;
- convert.py: HF <-> torch_dist with upstream's command lines (tools/convert_*.py).

This package imports nothing itself, so `checkpoint.layout` stays free of torch.
"""
