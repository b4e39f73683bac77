"""LocalSandbox (slime.agent.sandbox's local backend): no network, time and output limits, a private /tmp and
working directory, nothing left running or on disk after the context, paths confined; exec_and_wait's detached
launch and poll on it for real."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from slime.agent import sandbox
from slime.agent.local_sandbox import EXIT_TIMEOUT, WORKDIR, isolation_problem
from slime.agent.sandbox import LocalSandbox, exec_and_wait

pytestmark = pytest.mark.skipif(isolation_problem() is not None, reason=f"LocalSandbox: {isolation_problem()}")


def run(coro):
    return asyncio.run(coro)


def test_commands_have_no_network_and_a_private_tmp():
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]

    async def go():
        async with LocalSandbox() as sb:
            net = await sb.exec(f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected")
            where = await sb.exec("pwd; echo $HOME; ls -A /tmp; echo x > /tmp/mine")
            host_tmp = sorted(os.listdir("/tmp"))
            return net, where, await sb.read_file("/tmp/mine"), host_tmp, sb.root
    try:
        net, where, mine, host_tmp, root = run(go())
    finally:
        listener.close()
    assert net[0] != 0 and "connected" not in net[1]  # even the host's loopback is out of reach
    assert where[0] == 0 and where[1].split("\n")[:3] == [WORKDIR, WORKDIR, "work"]
    assert mine == "x\n" and "mine" not in host_tmp
    assert not root.exists()


def test_time_and_output_limits_and_check():
    async def go():
        async with LocalSandbox(max_output_bytes=1000) as sb:
            t0 = time.monotonic()
            slow = await sb.exec("echo started; sleep 30", timeout=1)
            elapsed = time.monotonic() - t0
            loud = await sb.exec("head -c 5000 /dev/zero | tr '\\0' a; head -c 3000 /dev/zero | tr '\\0' b >&2")
            with pytest.raises(RuntimeError, match=r"sandbox exec failed \(exit=3\)"):
                await sb.exec("exit 3", check=True)
            return slow, elapsed, loud, await sb.exec("exit 3")
    slow, elapsed, loud, failed = run(go())
    assert slow[0] == EXIT_TIMEOUT and slow[1] == "started\n" and "killed after 1 s" in slow[2] and elapsed < 20
    assert loud[1] == "a" * 1000 + "\n[output truncated: 4000 more bytes]"
    assert loud[2] == "b" * 1000 + "\n[output truncated: 2000 more bytes]"
    assert failed == (3, "", "")


def test_unprivileged_and_confined_paths():
    async def go():
        async with LocalSandbox() as sb:
            writes = await sb.exec("touch /etc/slime-sandbox-probe 2>/dev/null; echo $?; touch ~/ok; echo $?")
            await sb.exec("ln -s /etc/hostname link")
            await sb.write_file("sub/dir/f.txt", b"\x00bytes")
            read_back = await sb.exec("wc -c < sub/dir/f.txt")
            errors = []
            for path in ("/etc/hostname", "../../etc/hostname", "link"):
                try:
                    await sb.read_file(path)
                except ValueError as e:
                    errors.append(str(e))
            return writes, read_back, errors, await sb.read_file("missing")
    writes, read_back, errors, missing = run(go())
    assert writes[1].split() == (["0", "0"] if os.geteuid() != 0 else ["1", "0"])
    assert read_back[1].strip() == "6" and missing == ""
    assert len(errors) == 3 and "under /tmp or relative to" in errors[0] and "leaves the sandbox" in errors[1]
    assert not os.path.exists("/etc/slime-sandbox-probe")


def test_leaving_kills_detached_processes():
    async def go():
        async with LocalSandbox() as sb:
            code, out, _ = await sb.exec("setsid sleep 300 > /dev/null 2>&1 & echo $!")
            pid = int(out)
            alive = os.path.exists(f"/proc/{pid}")
        for _ in range(50):
            if not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z":
                return alive, True
            await asyncio.sleep(0.1)
        return alive, False
    assert run(go()) == (True, True)


def test_exec_and_wait_runs_detached_to_its_exit_code(monkeypatch):
    monkeypatch.setattr(sandbox, "DONE_MARKER_POLL_SEC", 0.2)

    async def go():
        async with LocalSandbox() as sb:
            ok = await exec_and_wait(sb, cmd="echo out; echo err >&2", time_budget_sec=30, tag="a", want_output=True)
            bad = await exec_and_wait(sb, cmd="echo why; (exit 7)", time_budget_sec=30, tag="b")
            again = await exec_and_wait(sb, cmd="true", time_budget_sec=30, tag="b")  # no stale marker
            late = await exec_and_wait(sb, cmd="sleep 30", time_budget_sec=1, tag="c")
            return ok, bad, again, late
    ok, bad, again, late = run(go())
    assert ok == (0, "out\nerr\n") and bad == (7, "why\n") and again == (0, "") and late[0] == -1
