"""SGLang launcher: command line and environment per accelerator (real accelerator classes used as
stand-ins: nothing here touches a device), and the child-process wrapper. SGLang is never imported."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from slime.accelerator import AscendAccelerator, CpuAccelerator, CudaAccelerator
from slime.backends.embedded.launcher import embedded_command, embedded_env
from slime.backends.sglang.launcher import SGLangLaunchSpec, sglang_command, sglang_env
from slime.backends.sglang.process import EngineStartError, ServerProcess
from slime.utils.net import free_port


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


@pytest.mark.parametrize("acc_cls, device_flags", [
    (CudaAccelerator, []),
    (AscendAccelerator, ["--device", "npu", "--attention-backend", "ascend"]),
    (CpuAccelerator, ["--device", "cpu"]),
])
def test_command_per_accelerator(acc_cls, device_flags):
    acc = acc_cls()
    spec = SGLangLaunchSpec(model_path="/m", port=31000, tp_size=2, device_ids=[2, 3], token="tok")
    cmd = sglang_command(spec, acc, python="/py")
    assert cmd[:3] == ["/py", "-m", "sglang.launch_server"]
    assert (_flag(cmd, "--model-path"), _flag(cmd, "--host"), _flag(cmd, "--port"), _flag(cmd, "--tp-size")) == \
        ("/m", "127.0.0.1", "31000", "2")
    assert _flag(cmd, "--api-key") == "tok"
    for flag, value in zip(device_flags[::2], device_flags[1::2]):
        assert _flag(cmd, flag) == value
    if not device_flags:
        assert "--device" not in cmd and "--attention-backend" not in cmd
    assert "--enable-memory-saver" not in cmd
    assert "sglang" not in sys.modules


def test_user_flags_override_defaults_and_memory_saver():
    spec = SGLangLaunchSpec(model_path="/m", port=1, extra_args=["--attention-backend", "torch_native",
                                                                 "--mem-fraction-static", "0.5"], memory_saver=True)
    cmd = sglang_command(spec, AscendAccelerator(), python="py")
    assert cmd.count("--attention-backend") == 1 and _flag(cmd, "--attention-backend") == "torch_native"
    assert _flag(cmd, "--device") == "npu" and _flag(cmd, "--mem-fraction-static") == "0.5"
    assert "--enable-memory-saver" in cmd


def test_accelerator_hook_wins():
    class Plugin(CpuAccelerator):
        name = "xpu-sim"

        def sglang_server_args(self):
            return ["--device", "xpu"]

    assert _flag(sglang_command(SGLangLaunchSpec("/m", 1), Plugin(), python="py"), "--device") == "xpu"


@pytest.mark.parametrize("acc_cls, visible", [(CudaAccelerator, "CUDA_VISIBLE_DEVICES"),
                                              (AscendAccelerator, "ASCEND_RT_VISIBLE_DEVICES")])
def test_env_pins_devices(acc_cls, visible):
    acc = acc_cls()
    spec = SGLangLaunchSpec(model_path="/m", port=1, tp_size=2, device_ids=[3, 1])
    env = sglang_env(spec, acc, base={"PATH": "/bin", visible: "0,1,2,3,4,5,6,7"})
    assert env[visible] == "1,3" and env["PATH"] == "/bin"
    assert {k: env[k] for k in acc.worker_env([1, 3])} == acc.worker_env([1, 3])  # collective settings too
    with pytest.raises(ValueError, match="tp_size 2 but 1 device ids"):
        sglang_env(SGLangLaunchSpec("/m", 1, tp_size=2, device_ids=[0]), acc, base={})


def test_cpu_env_and_embedded_command_keep_token_off_argv():
    env = sglang_env(SGLangLaunchSpec("/m", 1), CpuAccelerator(), base={"A": "1"})
    assert env == {"A": "1"}
    cmd = embedded_command("/m", 4242, max_running_requests=8, random_seed=3, python="py")
    assert cmd == ["py", "-m", "slime.backends.embedded", "--model-path", "/m", "--port", "4242", "--host", "127.0.0.1",
                   "--max-running-requests", "8", "--random-seed", "3"]
    env = embedded_env("secret", CpuAccelerator(), base={})
    assert env["SLIME_ENGINE_TOKEN"] == "secret" and "secret" not in cmd


_FAKE_SERVER = textwrap.dedent("""
    import sys, http.server
    print("fake engine starting", flush=True)
    if sys.argv[2] == "crash":
        print("fatal: out of memory", flush=True)
        sys.exit(3)
    if sys.argv[2] == "rendezvous-taken" and sys.argv[1] == sys.argv[3]:  # torch's TCPStore, as it words it
        print("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
              "address. port: 41999, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")
        sys.exit(1)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"{}")
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def test_server_process_health_log_and_clean_stop(tmp_path):
    port = free_port()
    server = ServerProcess("engine 7", [sys.executable, "-c", _FAKE_SERVER, str(port), "ok"], dict(os.environ),
                           str(tmp_path / "logs" / "e.log"), f"http://127.0.0.1:{port}")
    server.start()
    server.wait_healthy(timeout=30)
    assert server.running() and "fake engine starting" in server.log_tail()
    code = server.stop(grace=5)
    assert code == -15 and not server.running()  # SIGTERM to its process group


def test_server_process_that_dies_reports_code_and_log_tail(tmp_path):
    port = free_port()
    server = ServerProcess("engine 3", [sys.executable, "-c", _FAKE_SERVER, str(port), "crash"], dict(os.environ),
                           str(tmp_path / "e.log"), f"http://127.0.0.1:{port}")
    server.start()
    with pytest.raises(EngineStartError) as e:
        server.wait_healthy(timeout=30)
    msg = str(e.value)
    assert "engine 3" in msg and "exited with code 3" in msg and "fatal: out of memory" in msg


def test_command_follows_the_process_accelerator(accel):
    cmd = sglang_command(SGLangLaunchSpec("/m", 1), python="py")  # get_accelerator(): cpu, simulated npu, ...
    assert _flag(cmd, "--device") == {"cpu": "cpu", "npu": "npu"}.get(accel.name)
    if accel.name == "npu":
        assert _flag(cmd, "--attention-backend") == "ascend"


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(line.split()[1] for line in f if line.startswith("State:"))
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return "gone"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_server_dies_with_its_starter(tmp_path):
    """A starter killed with SIGKILL (as Ray kills actors) must not leave its engine server running."""
    import signal
    import subprocess
    import time

    port = free_port()
    starter = textwrap.dedent(f"""
        import os, sys, time
        from slime.backends.sglang.process import ServerProcess
        s = ServerProcess("engine 0", [sys.executable, "-c", {_FAKE_SERVER!r}, "{port}", "ok"], dict(os.environ),
                          {str(tmp_path / "e.log")!r}, "http://127.0.0.1:{port}")
        s.start(); s.wait_healthy(30)
        print(s.pid, flush=True)
        time.sleep(120)
    """)
    out = tmp_path / "out"
    with open(out, "w") as fo:
        proc = subprocess.Popen([sys.executable, "-c", starter], stdout=fo, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not out.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    server_pid = int(out.read_text().split()[0])
    assert _state(server_pid) in ("R", "S")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while _state(server_pid) in ("R", "S", "D") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _state(server_pid) in ("Z", "X", "gone")


@pytest.mark.parametrize("taken_by", ["http", "rendezvous"])
def test_engine_actor_moves_to_another_port_when_its_port_is_taken(tmp_path, taken_by):
    """The port was free when picked, but another process bound it first: the actor retries elsewhere (the
    HTTP port; or the rendezvous port of an engine over several processes, which torch reports in lower case)."""
    import socket

    from slime.ray.engine_actor import EngineSpec, RolloutEngineActor

    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(1)
    taken = blocker.getsockname()[1]

    class FakeEngineActor(RolloutEngineActor):
        def _build(self, port):  # the stand-in server fails with EADDRINUSE like any server would
            mode = "ok" if taken_by == "http" else "rendezvous-taken"
            return ServerProcess(f"rollout engine {self.spec.index}",
                                 [sys.executable, "-c", _FAKE_SERVER, str(port), mode, str(taken)],
                                 dict(os.environ), str(tmp_path / "engine-0.log"), f"http://127.0.0.1:{port}")

    actor = FakeEngineActor(EngineSpec(index=0, kind="embedded", model_path="/m", token="t", log_dir=str(tmp_path),
                                       startup_timeout=30))
    actor.port, actor.server = taken, actor._build(taken)
    try:
        url = actor.start()
        assert actor.port != taken and url.endswith(f":{actor.port}") and actor.status()["running"]
        assert actor.status()["starts"] == 2 and "address already in use" in open(tmp_path / "engine-0.log").read().lower()
    finally:
        actor.stop()
        blocker.close()


def test_multi_node_engine_flags_and_bind_address(monkeypatch):
    """An SGLang engine over several nodes gets SGLang's --nnodes/--node-rank/--dist-init-addr and listens on
    the node's address; without dist_init_addr it is one clear error."""
    from slime.utils.net import bind_host

    spec = SGLangLaunchSpec("/m", 31000, tp_size=16, host="10.0.0.5", nnodes=2, node_rank=1,
                            dist_init_addr="10.0.0.4:5000")
    cmd = sglang_command(spec, CpuAccelerator(), python="py")
    assert (_flag(cmd, "--host"), _flag(cmd, "--nnodes"), _flag(cmd, "--node-rank"), _flag(cmd, "--dist-init-addr")) == \
        ("10.0.0.5", "2", "1", "10.0.0.4:5000")
    with pytest.raises(ValueError, match="needs dist_init_addr"):
        sglang_command(SGLangLaunchSpec("/m", 1, nnodes=2), CpuAccelerator(), python="py")
    monkeypatch.delenv("SLIME_BIND_HOST", raising=False)
    assert bind_host() == "127.0.0.1"  # no multi-node Ray cluster here
    monkeypatch.setenv("SLIME_BIND_HOST", "10.0.0.9")
    assert bind_host() == "10.0.0.9"
