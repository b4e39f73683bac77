"""Changes to a third-party module that must happen the moment it finishes executing, before the other
modules of its library import it. Installed by `import slime`; standard library only, so importing slime
stays light, and nothing happens unless a listed module is imported.

megatron.core.jit: megatron's modules wrap functions in its `jit_fuser` (torch.compile) while they are
imported, so a patch applied afterwards can only swap the wrapped functions back
(slime/accelerator/megatron_patches/jit.py), and torch._dynamo / TorchInductor have been imported by
then (~1.7 s of CPU per process). Made eager here first, they are never imported on such a device.
"""

from __future__ import annotations

import importlib
import importlib.abc
import logging
import sys

logger = logging.getLogger(__name__)

# module -> "package.module:function", called with the module object right after the module executed
AFTER_EXEC = {"megatron.core.jit": "slime.accelerator.megatron_patches.jit:after_megatron_jit_import"}


def _run_hook(where: str, module) -> None:
    mod_name, func_name = where.split(":")
    try:
        getattr(importlib.import_module(mod_name), func_name)(module)
    except Exception as e:  # the library still imports; the patch set applied later covers the change
        logger.warning("import hook %s for %s failed (%s: %s); continuing without it", where, module.__name__,
                       type(e).__name__, e)


class _AfterExecFinder(importlib.abc.MetaPathFinder):
    """Finds a listed module through the rest of sys.meta_path and runs its hook after it executes."""

    def find_spec(self, fullname, path, target=None):
        where = AFTER_EXEC.get(fullname)
        if where is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module  # the loader instance is this spec's own

        def exec_then_hook(module):
            exec_module(module)
            _run_hook(where, module)

        loader.exec_module = exec_then_hook
        return spec


def install() -> None:
    """Once per process; a listed module imported before this keeps its own behaviour (see AFTER_EXEC)."""
    if not any(isinstance(f, _AfterExecFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterExecFinder())
