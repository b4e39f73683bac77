"""`python -m slime.backends.sglang.guard PARENT_PID -- CMD...`: exec CMD so that it receives SIGTERM
when the process that started it dies (Linux PR_SET_PDEATHSIG; survives exec).

Engine servers run in their own session so they can be stopped as a group; that also means a Ray
actor killed with SIGKILL would leave them running, holding ports, memory and devices. The guard
ties the server's life to its starter without a watchdog thread in the starter.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: python -m slime.backends.sglang.guard PARENT_PID -- CMD...")
    parent, cmd = int(argv[0]), argv[2:]
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        except OSError:
            pass
    if os.getppid() != parent:  # the starter died before the signal was armed
        sys.exit(f"guard: parent {parent} is gone; not starting {cmd[0]}")
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
