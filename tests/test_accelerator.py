"""slime.accelerator: conformance of every backend, CPU behaviour, and CUDA/Ascend logic on stand-ins.

The CUDA and Ascend classes are exercised on CPU through stand-in device modules that follow
the documented `torch.cuda` / `torch.npu` APIs; a real-device run is parametrized in and skipped
when the device is absent.
"""

from __future__ import annotations

import inspect
import os
import pickle
import subprocess
import sys
import types

import pytest
import torch
import torch.multiprocessing as mp

from slime.accelerator import (
    MEMORY_STAT_KEYS,
    Accelerator,
    AcceleratorUnavailable,
    AscendAccelerator,
    Capabilities,
    CpuAccelerator,
    CudaAccelerator,
    accelerator_names,
    get_accelerator,
    set_accelerator,
)
from slime.accelerator import registry
from slime.accelerator.ipc import UnsafeHandleError, deserialize_named_tensors, serialize_named_tensors
from slime.utils.net import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL_CLASSES = [CpuAccelerator, CudaAccelerator, AscendAccelerator]

EXPECTED_IDENTITY = {
    CpuAccelerator: ("cpu", "cpu", "gloo", None, None),
    CudaAccelerator: ("cuda", "cuda", "nccl", "CUDA_VISIBLE_DEVICES", "GPU"),
    AscendAccelerator: ("npu", "npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES", "NPU"),
}


# --------------------------------------------------------------------------------- conformance
@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_every_abstract_member_is_implemented(cls):
    assert issubclass(cls, Accelerator)
    assert not inspect.isabstract(cls), f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)} abstract"
    abstract = {n for n, v in inspect.getmembers(Accelerator) if getattr(v, "__isabstractmethod__", False)}
    assert len(abstract) >= 19
    for member in abstract:
        impl = inspect.getattr_static(cls, member)
        assert not getattr(impl, "__isabstractmethod__", False), f"{cls.__name__}.{member} is abstract"


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_identity_attributes(cls):
    got = (cls.name, cls.device_type, cls.dist_backend, cls.visible_devices_env, cls.ray_resource)
    assert got == EXPECTED_IDENTITY[cls]


def test_interface_size_is_small():
    public = [n for n in dir(Accelerator) if not n.startswith("_")]
    # 43 since colocated_env (HCCL port ranges for devices shared by trainer and engine communicators); 44 since
    # launcher_env (the device environment of upstream's job launcher, command_utils.execute_train).
    assert 25 <= len(public) <= 44, public


def test_detection_order_prefers_npu_then_cuda_then_cpu():
    names = accelerator_names()
    assert names.index("npu") < names.index("cuda") < names.index("cpu") == len(names) - 1


def test_registration_priority_semantics(monkeypatch):
    # Lower priority probed first; no priority = DEFAULT_PRIORITY (after the built-in devices, before cpu);
    # re-registering a name keeps its place unless a priority is given.
    for attr in ("_CLASSES", "_PRIORITIES"):
        monkeypatch.setattr(registry, attr, dict(getattr(registry, attr)))
    monkeypatch.setattr(registry, "_DETECTION_ORDER", list(registry._DETECTION_ORDER))
    plain = type("PlainPlugin", (CpuAccelerator,), {"name": "plainplugin"})
    first = type("FirstPlugin", (CpuAccelerator,), {"name": "firstplugin"})
    registry.register_accelerator(plain)
    registry.register_accelerator(first, priority=0)
    names = accelerator_names()
    assert names[0] == "firstplugin" and names[-1] == "cpu"
    assert names.index("cuda") < names.index("plainplugin") < names.index("cpu")
    registry.register_accelerator(type("Cuda2", (CudaAccelerator,), {}))  # same name "cuda", no priority
    assert accelerator_names() == names


# --------------------------------------------------------------------------------- CPU backend
def test_cpu_is_detected_here():
    out = subprocess.run(
        [sys.executable, "-c", "from slime.accelerator import get_accelerator as g; print(g().name)"],
        capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "SLIME_ACCELERATOR"},
        cwd=REPO, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "cpu"


def test_cpu_device_and_streams():
    acc = CpuAccelerator()
    assert acc.device() == torch.device("cpu") and isinstance(acc.device(0), torch.device)
    assert acc.current_device() == torch.device("cpu") and acc.device_count() == 1
    s = acc.Stream()
    with acc.stream(s) as entered:
        assert entered is s
    start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
    start.record(acc.current_stream())
    torch.randn(64, 64) @ torch.randn(64, 64)
    end.record()
    assert end.query() and start.elapsed_time(end) >= 0.0
    acc.synchronize()


def test_cpu_memory_stats_track_allocations():
    acc = CpuAccelerator()
    acc.reset_peak_memory_stats()
    before = acc.memory_stats()
    assert set(MEMORY_STAT_KEYS) <= set(before)
    assert all(isinstance(before[k], int) for k in MEMORY_STAT_KEYS)
    assert 0 < before["allocated"] <= before["total"] and 0 < before["free"] <= before["total"]
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    after = acc.memory_stats()
    assert after["allocated"] - before["allocated"] > 48 * 2**20
    del big
    assert acc.memory_stats()["peak_allocated"] >= after["allocated"]


def test_cpu_rng_state_round_trip():
    acc = CpuAccelerator()
    acc.manual_seed(1234)
    state = acc.get_rng_state()
    a = torch.randn(5)
    acc.set_rng_state(state)
    assert torch.equal(a, torch.randn(5))


def _child_modify(handle: bytes, q) -> None:
    from slime.accelerator import CpuAccelerator

    t = CpuAccelerator().open_tensor(handle)
    t.mul_(2).add_(1)
    q.put(float(t.sum()))


def test_cpu_ipc_round_trip_into_spawned_process():
    acc = CpuAccelerator()
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)[:, 1:]  # a strided view: offsets must survive
    expected = t * 2 + 1
    handle = acc.share_tensor(t)
    assert isinstance(handle, bytes) and len(handle) < 4096  # a reference, not the data
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child_modify, args=(handle, q))
    p.start()
    child_sum = q.get(timeout=120)
    p.join(60)
    assert p.exitcode == 0
    assert torch.equal(t, expected), "parent does not see the child's in-place change"
    assert child_sum == pytest.approx(float(expected.sum()))


def test_named_tensor_payload_round_trip_and_refusals():
    acc = CpuAccelerator()
    named = [("a.weight", torch.randn(3, 2)), ("b.bias", torch.arange(4, dtype=torch.int64))]
    out = deserialize_named_tensors(serialize_named_tensors(acc, named), acc.ipc_rebuild_allowlist())
    assert [n for n, _ in out] == ["a.weight", "b.bias"]
    for (_, a), (_, b) in zip(named, out):
        assert torch.equal(a, b) and a.dtype == b.dtype

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with pytest.raises(UnsafeHandleError, match="posix.system|os.system|not an allowed"):
        acc.open_tensor(pickle.dumps(Evil()))
    with pytest.raises(UnsafeHandleError):
        acc.open_tensor(pickle.dumps({"not": "a tensor"}))
    with pytest.raises(UnsafeHandleError):
        deserialize_named_tensors(pickle.dumps([("x", 1)]), acc.ipc_rebuild_allowlist())


def _allreduce_worker(rank: int, world: int, port: int, q) -> None:
    import torch.distributed as dist

    from slime.accelerator import get_accelerator

    acc = get_accelerator()
    dist.init_process_group(acc.process_group_backend(), init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    t = torch.full((5,), float(rank + 1), device=acc.device())
    dist.all_reduce(t)
    q.put((rank, t.tolist()))
    dist.destroy_process_group()


def test_two_process_all_reduce_over_process_group_backend():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert results == {0: [3.0] * 5, 1: [3.0] * 5}


# --------------------------------------------------------------------------------- selection
def _run_cli(env_extra: dict[str, str], argv: tuple[str, ...] = ("-m", "slime.accelerator", "--name")):
    env = {k: v for k, v in os.environ.items() if k not in ("SLIME_ACCELERATOR", "SLIME_DEBUG")}
    env.update(env_extra)
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)


def test_explicit_npu_request_fails_with_one_clear_line():
    out = _run_cli({"SLIME_ACCELERATOR": "npu"})
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stderr
    assert "torch_npu" in lines[0] and "CANN" in lines[0] and "docs/ascend.md" in lines[0]
    assert "Traceback" not in out.stderr


def test_library_use_keeps_the_process_excepthook():
    # Only the CLI entry points shorten the error; importing slime never replaces sys.excepthook.
    code = ("import sys; hook = sys.excepthook\n"
            "from slime.accelerator import get_accelerator, AcceleratorUnavailable\n"
            "try:\n    get_accelerator()\nexcept AcceleratorUnavailable:\n    pass\n"
            "print(sys.excepthook is hook)")
    out = _run_cli({"SLIME_ACCELERATOR": "npu"}, ("-c", code))
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr


def test_train_entry_point_prints_one_line_for_an_unmet_device():
    out = _run_cli({"SLIME_ACCELERATOR": "npu"}, ("-c", "import sys; from slime.accelerator import get_accelerator;"
                                                         "from slime.accelerator.cli import one_line_errors;"
                                                         "sys.exit(one_line_errors(lambda: get_accelerator())())"))
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("slime: SLIME_ACCELERATOR=npu"), out.stderr


def test_unknown_accelerator_lists_valid_names():
    out = _run_cli({"SLIME_ACCELERATOR": "bogus"})
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "bogus" in lines[0]
    for name in ("cpu", "cuda", "npu"):
        assert name in lines[0]


def test_env_override_and_cache(monkeypatch):
    previous = get_accelerator()
    try:
        monkeypatch.setenv("SLIME_ACCELERATOR", "cpu")
        set_accelerator(None)
        acc = get_accelerator()
        assert isinstance(acc, CpuAccelerator) and get_accelerator() is acc
        monkeypatch.setenv("SLIME_ACCELERATOR", "cuda")
        set_accelerator(None)
        if not CudaAccelerator.is_available():
            with pytest.raises(AcceleratorUnavailable, match="cuda"):
                get_accelerator()
        monkeypatch.setenv("SLIME_ACCELERATOR", "nope")
        set_accelerator(None)
        with pytest.raises(AcceleratorUnavailable, match="valid names: cpu, cuda, npu"):
            get_accelerator()
    finally:
        set_accelerator(previous)


def test_plugin_import_failure_is_one_line(monkeypatch):
    previous = get_accelerator()
    try:
        monkeypatch.setenv(registry.PLUGINS_ENV_VAR, "no_such_accelerator_plugin_xyz")
        set_accelerator(None)
        with pytest.raises(AcceleratorUnavailable, match="no_such_accelerator_plugin_xyz"):
            get_accelerator()
    finally:
        set_accelerator(previous)


# --------------------------------------------------------------------------------- stand-ins
class FakeDeviceModule(types.SimpleNamespace):
    """Follows the documented torch.cuda / torch.npu runtime API closely enough to drive the logic."""

    def __init__(self, n: int = 4, name: str = "Fake"):
        super().__init__()
        self._n, self._cur, self._name = n, 0, name
        self._alloc, self._peak, self._seed, self.synced = 3 << 20, 5 << 20, None, 0
        self.Stream = type("Stream", (), {})
        self.Event = type("Event", (), {})

    def is_available(self):
        return True

    def device_count(self):
        return self._n

    def set_device(self, i):
        if not 0 <= i < self._n:
            raise RuntimeError("invalid device ordinal")
        self._cur = i

    def current_device(self):
        return self._cur

    def synchronize(self):
        self.synced += 1

    def current_stream(self):
        return "stream0"

    def stream(self, s):
        import contextlib

        return contextlib.nullcontext(s)

    def memory_allocated(self):
        return self._alloc

    def memory_reserved(self):
        return 8 << 20

    def max_memory_allocated(self):
        return self._peak

    def mem_get_info(self):
        return (70 << 30, 80 << 30)

    def reset_peak_memory_stats(self):
        self._peak = self._alloc

    def empty_cache(self):
        pass

    def manual_seed_all(self, seed):
        self._seed = seed

    def get_rng_state(self):
        return torch.tensor([self._seed or 0], dtype=torch.uint8)

    def set_rng_state(self, s):
        self._seed = int(s[0])

    def is_bf16_supported(self):
        return True

    def get_device_capability(self):
        return (9, 0)

    def get_device_name(self):
        return self._name


@pytest.fixture
def fake_cuda(monkeypatch):
    mod = FakeDeviceModule(name="NVIDIA H200")
    monkeypatch.setattr(CudaAccelerator, "_module", lambda self: mod)
    return mod


@pytest.fixture
def fake_npu(monkeypatch):
    mod = FakeDeviceModule(n=8, name="Ascend950PR")
    monkeypatch.setattr(AscendAccelerator, "_module", lambda self: mod)
    return mod


def check_device_module_backend(cls, mod) -> None:
    acc = cls()
    acc.set_device(3)
    assert acc.current_device() == torch.device(cls.device_type, 3)
    assert acc.device() == torch.device(cls.device_type, 3) and acc.device(1) == torch.device(cls.device_type, 1)
    with pytest.raises(RuntimeError):
        acc.set_device(99)
    stats = acc.memory_stats()
    assert stats == {"allocated": 3 << 20, "reserved": 8 << 20, "peak_allocated": 5 << 20,
                     "total": 80 << 30, "free": 70 << 30}
    acc.reset_peak_memory_stats()
    assert acc.memory_stats()["peak_allocated"] == 3 << 20
    acc.manual_seed(7)
    assert mod._seed == 7 and int(acc.get_rng_state()[0]) == 7
    acc.synchronize()
    assert mod.synced == 1
    assert acc.Stream is mod.Stream and acc.Event is mod.Event
    assert acc.process_group_backend() == f"cpu:gloo,{cls.device_type}:{cls.dist_backend}"
    env = acc.worker_env([3, 1])
    assert env[cls.visible_devices_env] == "1,3"  # ascending, no spaces
    assert env[f"RAY_EXPERIMENTAL_NOSET_{cls.visible_devices_env}"] == "1"
    assert isinstance(acc.capabilities, Capabilities)
    with pytest.raises(ValueError):
        acc.worker_env([-1])


def test_cuda_backend_on_stand_in(fake_cuda):
    check_device_module_backend(CudaAccelerator, fake_cuda)


def _ascend_stand_in_child(q) -> None:
    # torch.device("npu") needs the PrivateUse1 backend renamed, as importing torch_npu does. The
    # rename is process-wide and permanent, so it happens in a child process, not in the test session.
    import traceback

    try:
        torch.utils.rename_privateuse1_backend("npu")
        mod = FakeDeviceModule(n=8, name="Ascend950PR")
        AscendAccelerator._module = lambda self: mod
        check_device_module_backend(AscendAccelerator, mod)
        q.put("ok")
    except BaseException:
        q.put(traceback.format_exc())


def test_ascend_backend_on_stand_in():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_ascend_stand_in_child, args=(q,))
    p.start()
    result = q.get(timeout=120)
    p.join(60)
    assert result == "ok", result


def test_cuda_env_and_capabilities(fake_cuda):
    acc = CudaAccelerator()
    env = acc.worker_env([0])
    assert env["NCCL_CUMEM_ENABLE"] == "0"
    caps = acc.capabilities
    assert caps.ipc and caps.bf16 and caps.graphs


def test_ascend_env_and_ipc_capability(fake_npu, monkeypatch):
    acc = AscendAccelerator()
    env = acc.worker_env([0, 1])
    assert env["HCCL_CONNECT_TIMEOUT"].isdigit() and 120 <= int(env["HCCL_CONNECT_TIMEOUT"]) <= 7200
    # long collectives are bounded by the execution timeout, not the connect one (CANN default 1836 s)
    assert env["HCCL_EXEC_TIMEOUT"].isdigit() and int(env["HCCL_EXEC_TIMEOUT"]) > 1836
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "900")
    assert acc.worker_env([0])["HCCL_EXEC_TIMEOUT"] == "900"  # the user's value wins
    assert env["PYTORCH_NPU_ALLOC_CONF"].startswith("expandable_segments")
    assert acc.capabilities.ipc is True
    fake_npu._name = "Ascend950DT"
    assert acc.capabilities.ipc is False  # documented: 950DT has no IPC
    with pytest.raises(RuntimeError, match="distributed weight-sync"):
        acc.share_tensor(torch.zeros(1))
    monkeypatch.setenv("SLIME_NPU_IPC", "1")
    assert acc.capabilities.ipc is True


def test_ascend_ipc_allowlist_admits_sglangs_npu_rebuild_when_sglang_is_present(monkeypatch):
    """SGLang replaces torch_npu's rebuild_npu_tensor with its own wrapper when it loads; a handle pickled
    in such a process names the wrapper, which must open (and only when SGLang is installed)."""
    import importlib.util

    from slime.accelerator.ascend import accelerator as ascend_mod

    npu_reductions = types.ModuleType("torch_npu.multiprocessing.reductions")

    def _rebuild_npu_tensor_modified(*args):
        return args

    _rebuild_npu_tensor_modified.__module__ = "sglang.srt.utils.patch_torch"
    npu_reductions.rebuild_npu_tensor = _rebuild_npu_tensor_modified
    monkeypatch.setitem(sys.modules, "torch_npu.multiprocessing.reductions", npu_reductions)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "sglang" else real_find_spec(name, *a))
    allowed = AscendAccelerator().ipc_rebuild_allowlist()
    assert ascend_mod.SGLANG_NPU_REBUILD in allowed
    assert ("sglang.srt.utils.patch_torch", "_rebuild_npu_tensor_modified") in allowed
    assert ("torch_npu.multiprocessing.reductions", "rebuild_npu_tensor") in allowed
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real_find_spec(name, *a))
    npu_reductions.rebuild_npu_tensor = lambda *a: a  # torch_npu's own, SGLang absent
    npu_reductions.rebuild_npu_tensor.__module__ = "torch_npu.multiprocessing.reductions"
    assert ascend_mod.SGLANG_NPU_REBUILD not in AscendAccelerator().ipc_rebuild_allowlist()


def test_ascend_detection_paths(monkeypatch):
    import importlib.util

    from slime.accelerator.ascend import accelerator as ascend_mod

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch_npu" else real_find_spec(name, *a))
    assert AscendAccelerator.is_available() is False
    assert "not installed" in AscendAccelerator.unavailable_reason()

    # Installed but CANN missing: the import raises OSError (libhccl.so), as documented.
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())

    def broken_import():
        raise OSError("libhccl.so: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(ascend_mod, "import_torch_npu", broken_import)
    assert AscendAccelerator.is_available() is False
    reason = AscendAccelerator.unavailable_reason()
    assert "libhccl.so" in reason and "CANN" in reason and "\n" not in reason

    # Importable with a device present.
    fake = FakeDeviceModule(n=2)
    monkeypatch.setattr(ascend_mod, "import_torch_npu", lambda: None)
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    assert AscendAccelerator.is_available() is True
    fake._n = 0
    assert AscendAccelerator.is_available() is False


def test_import_does_not_touch_device_runtimes():
    # Importing slime neither initializes a device runtime nor probes optional kernel libraries / op providers.
    code = (
        "import sys, slime, slime.accelerator, slime.accelerator.ascend, slime.accelerator.ops; "
        "bad = [m for m in ('torch_npu', 'flash_attn', 'sglang', 'megatron', 'slime.accelerator.ascend.ops', "
        "'slime.accelerator.ops.cuda') if m in sys.modules]; "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


# --------------------------------------------------------------------------------- real devices
REAL = [pytest.param(c, marks=pytest.mark.device) for c in (CudaAccelerator, AscendAccelerator)]


@pytest.mark.parametrize("cls", REAL, ids=lambda c: c.__name__)
def test_real_device_basics(cls):
    if cls is AscendAccelerator and os.environ.get("SLIME_TEST_NPU") != "1":
        pytest.skip("set SLIME_TEST_NPU=1 on an Ascend machine")
    if not cls.is_available():
        pytest.skip(f"no {cls.name} device here")
    acc = cls()
    acc.set_device(0)
    x = torch.randn(256, 256, device=acc.device())
    before = acc.memory_stats()
    y = x @ x
    acc.synchronize()
    assert set(MEMORY_STAT_KEYS) <= set(before)
    assert torch.allclose(y.cpu().double(), x.cpu().double() @ x.cpu().double(), atol=1e-2, rtol=1e-2)


def test_cpu_peak_memory_is_the_high_water_mark_between_samples():
    """A buffer allocated and freed between two memory_stats() calls still shows in the peak (the kernel's
    VmHWM, reset by reset_peak_memory_stats), and a reset drops an earlier, higher peak."""
    acc = CpuAccelerator()
    big = torch.ones(96 * 2**20 // 4)  # 96 MiB, touched, freed before any sample
    del big
    acc.reset_peak_memory_stats()
    start = acc.memory_stats()
    transient = torch.ones(64 * 2**20 // 4)  # 64 MiB, never sampled while alive
    del transient
    stats = acc.memory_stats()
    assert stats["peak_allocated"] - start["allocated"] > 48 * 2**20
    acc.reset_peak_memory_stats()
    assert acc.memory_stats()["peak_allocated"] < stats["peak_allocated"]
