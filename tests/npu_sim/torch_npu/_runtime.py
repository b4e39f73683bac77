"""SIMULATED `torch.npu` runtime module: the documented torch.cuda-mirroring API, backed by the host.

Not hardware: "devices" are CPU memory; streams and events are synchronous; memory figures come
from the process RSS and the host's memory.
"""

from __future__ import annotations

import contextlib
import sys
import time
import types

import torch

from . import _common

_state = {"device": 0, "count": 1, "peak": 0}


class Stream:
    def __init__(self, device=None, priority: int = 0) -> None:
        self.device = device

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self._t: float | None = None

    def record(self, stream=None) -> None:
        self._t = time.perf_counter()

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "Event") -> float:
        if self._t is None or end._t is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end._t - self._t) * 1000.0


def _rss() -> int:
    import psutil

    rss = int(psutil.Process().memory_info().rss)
    _state["peak"] = max(_state["peak"], rss)
    return rss


def _check_index(device) -> int:
    index = device.index if isinstance(device, torch.device) else int(device)
    if index is None:
        index = _state["device"]
    if not 0 <= index < _state["count"]:
        raise RuntimeError(f"Invalid device id {index}: {_state['count']} simulated NPU(s) visible")
    return index


def build_module() -> types.ModuleType:
    m = types.ModuleType("torch.npu", "SIMULATED torch.npu (tests/npu_sim): host-backed, not hardware.")
    m.SIMULATED = True
    m.Stream, m.Event = Stream, Event
    m.is_available = lambda: True
    m.device_count = lambda: _state["count"]

    def set_device(device) -> None:
        _state["device"] = _check_index(device)

    m.set_device = set_device
    m.current_device = lambda: _state["device"]
    m.synchronize = lambda device=None: None
    m.current_stream = lambda device=None: Stream(device)
    m.default_stream = lambda device=None: Stream(device)

    @contextlib.contextmanager
    def stream(s):
        yield s

    m.stream = stream
    m.memory_allocated = lambda device=None: _rss()
    m.memory_reserved = lambda device=None: _rss()
    m.max_memory_allocated = lambda device=None: max(_state["peak"], _rss())
    m.max_memory_reserved = m.max_memory_allocated

    def mem_get_info(device=None):
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    m.mem_get_info = mem_get_info

    def memory_stats(device=None) -> dict:
        rss = _rss()
        return {"allocated_bytes.all.current": rss, "allocated_bytes.all.peak": _state["peak"],
                "reserved_bytes.all.current": rss}

    m.memory_stats = memory_stats

    def reset_peak_memory_stats(device=None) -> None:
        _state["peak"] = 0
        _rss()

    m.reset_peak_memory_stats = reset_peak_memory_stats
    m.empty_cache = lambda: None
    m.ipc_collect = lambda: None
    m.manual_seed = lambda seed: torch.manual_seed(seed) and None
    m.manual_seed_all = lambda seed: torch.manual_seed(seed) and None
    m.seed = lambda: torch.seed() and None
    m.get_rng_state = lambda device="npu": torch.get_rng_state()
    m.set_rng_state = lambda state, device="npu": torch.set_rng_state(state)
    m.is_bf16_supported = lambda: True
    m.get_device_name = lambda device=None: f"{_common.SOC_DEVICE_NAMES[_common.soc()]} (simulated)"
    m.get_device_capability = lambda device=None: (9, 5)
    return m


_saved: list = []


def install() -> types.ModuleType:
    """Put the stand-in at torch.npu (what importing the real torch_npu does); returns it."""
    module = sys.modules.get("torch.npu")
    if module is None or not getattr(module, "SIMULATED", False):
        module = build_module()
    _saved.append((getattr(torch, "npu", None), sys.modules.get("torch.npu")))
    torch.npu = module
    sys.modules["torch.npu"] = module
    return module


def uninstall() -> None:
    """Restore what install() replaced."""
    if not _saved:
        return
    attr, mod = _saved.pop()
    if attr is None:
        if hasattr(torch, "npu"):
            delattr(torch, "npu")
    else:
        torch.npu = attr
    if mod is None:
        sys.modules.pop("torch.npu", None)
    else:
        sys.modules["torch.npu"] = mod
