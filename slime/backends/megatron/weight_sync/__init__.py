"""Trainer -> rollout engine weight sync, through the accelerator, over SGLang's HTTP protocol.

One controller (controller.py: pause, stage every exported bucket, gather every pipeline stage's outcome,
flush and resume, verify; all or nothing) drives one transport per mode:

- weight_sets.py (ipc, one embedded engine that offers weight sets): each tensor copied once into the set
  the engine does not read, then committed.
- tensor_handles.py (ipc, otherwise): flat shared buffers (shared_buckets.py) posted as SGLang's
  `/update_weights_from_tensor` with `load_format: "flattened_bucket"`.
- broadcast.py (distributed): a collective group with the engines, `/update_weights_from_distributed`.
- disk.py (disk): a complete safetensors checkpoint per sync under --update-weight-disk-dir, loaded by every
  engine through `/update_weights_from_disk`.

factory.py builds a rank's WeightSync from the run's flags (auto: ipc when colocated and the device
supports IPC, else distributed). Upstream slime keeps the same parts under
`slime/backends/megatron_utils/update_weight/` (update_weight_from_tensor.py, update_weight_from_distributed.py,
update_weight_from_disk.py); its delta transports are not built here.
"""

from slime.backends.megatron.weight_sync.common import (GROUP_NAME, EngineEndpoint, StageRole, WeightSyncError,
                                                        default_get, default_post)
from slime.backends.megatron.weight_sync.controller import WeightSync
from slime.backends.megatron.weight_sync.factory import (create_weight_sync, engines_load_mtp, resolve_mode,
                                                         stage_role, without_mtp_layers)
from slime.backends.megatron.weight_sync.tensor_handles import PayloadExchange

__all__ = ["GROUP_NAME", "EngineEndpoint", "PayloadExchange", "StageRole", "WeightSync", "WeightSyncError",
           "create_weight_sync", "default_get", "default_post", "engines_load_mtp", "resolve_mode", "stage_role",
           "without_mtp_layers"]
