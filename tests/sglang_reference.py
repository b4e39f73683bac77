"""SGLang's own weight-sync classes, taken from the installed `sglang` package (the version pinned in
pyproject's `sglang-test` extra), for tests that check this project's payloads and groups against them.

`import sglang.srt...` cannot run on this CPU stack: `sglang/__init__.py` imports `sglang.srt.utils`, whose
`common.py` does `import triton` at module level (line 91 in 0.5.23) and patches it on import. The CPU torch
wheel ships no triton (a 286 MB GPU compiler), and an empty stand-in module breaks torch._dynamo, which then
believes triton is present. So this loads SGLang's source without executing its package `__init__`s:
- `sglang/srt/weight_sync/tensor_bucket.py` (it imports only torch) as the module of its real name, so
  pickles name its classes exactly as SGLang's do (its parent packages `sglang`, `sglang.srt`,
  `sglang.srt.weight_sync` are entered in sys.modules as bare packages, without running their `__init__`);
- from `sglang/srt/utils/common.py`, the unchanged source of `MultiprocessingSerializer`, `SafeUnpickler`
  (with `_safe_load_torch_storage`, which it calls) and `init_custom_process_group`, compiled into a module
  with the imports they use (io, pickle, ForkingPickler, pybase64, torch, torch_release).
"""

from __future__ import annotations

import ast
import importlib.util
import io
import os
import pickle
import sys
import types

COMMON_NAMES = ("_safe_load_torch_storage", "SafeUnpickler", "MultiprocessingSerializer", "init_custom_process_group")


def sglang_root() -> str | None:
    spec = importlib.util.find_spec("sglang")  # finds the package without running its __init__
    return os.path.dirname(spec.origin) if spec and spec.origin else None


def available() -> bool:
    root = sglang_root()
    return bool(root) and importlib.util.find_spec("pybase64") is not None and os.path.exists(
        os.path.join(root, "srt", "weight_sync", "tensor_bucket.py"))


def tensor_bucket() -> types.ModuleType:
    name = "sglang.srt.weight_sync.tensor_bucket"
    if name not in sys.modules:
        root, real = sglang_root(), importlib.util.find_spec("sglang")
        for pkg, sub in (("sglang", ""), ("sglang.srt", "srt"), ("sglang.srt.weight_sync", "srt/weight_sync")):
            if pkg not in sys.modules:  # pickle imports a global's top-level package first
                mod = types.ModuleType(pkg)
                mod.__path__ = [os.path.join(root, sub)]
                mod.__spec__ = real if pkg == "sglang" else None
                sys.modules[pkg] = mod
        spec = importlib.util.spec_from_file_location(name, os.path.join(sglang_root(), "srt", "weight_sync",
                                                                         "tensor_bucket.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def common() -> types.ModuleType:
    name = "sglang_reference_common"
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(sglang_root(), "srt", "utils", "common.py")
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    picked = [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name in COMMON_NAMES]
    missing = set(COMMON_NAMES) - {n.name for n in picked}
    if missing:
        raise RuntimeError(f"{path} no longer defines {sorted(missing)}; update tests/sglang_reference.py")
    from multiprocessing.reduction import ForkingPickler

    import pybase64
    import torch
    from packaging import version as pkg_version

    mod = types.ModuleType(name)
    mod.__dict__.update(io=io, pickle=pickle, ForkingPickler=ForkingPickler, pybase64=pybase64, torch=torch,
                        torch_release=pkg_version.parse(torch.__version__).release)
    exec(compile(ast.Module(body=picked, type_ignores=[]), path, "exec"), mod.__dict__)
    sys.modules[name] = mod
    return mod


def unload() -> None:
    """Take the modules entered above out of sys.modules again (other tests check that sglang is not imported)."""
    for name in ("sglang.srt.weight_sync.tensor_bucket", "sglang.srt.weight_sync", "sglang.srt", "sglang",
                 "sglang_reference_common"):
        mod = sys.modules.get(name)
        if mod is not None and (name == "sglang_reference_common" or getattr(mod, "__file__", None) is None
                                or name.endswith("tensor_bucket")):
            sys.modules.pop(name, None)
