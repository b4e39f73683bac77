"""The test modules' clean-up of megatron state (tests/conftest.py's autouse `clean_megatron_state`; a test that
needs it between its own steps calls it too). Imports only what the process has imported already, so a module
that never used megatron-core or torch.distributed pays nothing."""

from __future__ import annotations

import sys


def megatron_state_cleanup():
    """Generator for a fixture: afterwards, drop the process group created meanwhile, megatron's parallel state
    and the megatron patches applied (the next test module starts from a clean process)."""
    dist = sys.modules.get("torch.distributed")
    had_group = dist is not None and dist.is_initialized()
    yield
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and not had_group and dist.is_initialized():
        dist.destroy_process_group()
    if "megatron.core" in sys.modules:  # megatron patches exist only where megatron-core was imported
        from slime.backends.megatron.parallel import revert_megatron_patches

        revert_megatron_patches()
