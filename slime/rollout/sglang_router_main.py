"""`python -m slime.rollout.sglang_router_main ARGS`: sglang-router's Rust router, started with the arguments of
`python -m sglang_router.launch_router ARGS`, without importing the Python load balancer next to it.

Why: sglang_router.launch_router imports sglang_router.mini_lb at the top (its debugging-only Python balancer),
which imports sglang, and with it torch: 2.5 core-s per router start on a 2-core machine (docs/performance.md),
in every run, on the start-up's critical path, for a module the Rust router never uses. This module parses the
same command line with the package's own RouterArgs and starts the same Router. `--mini-lb` (which does need
sglang) is handed to the package's launcher unchanged. Written against sglang-router 0.3.2 (pyproject pins
>=0.3.2,<0.4); if a release stops importing mini_lb at the top, slime.rollout.sglang_router can launch
`sglang_router.launch_router` again and this module can go.
"""

from __future__ import annotations

import argparse
import runpy
import sys


def main(argv: list[str]) -> None:
    if "--mini-lb" in argv:  # the Python balancer: the package's own launcher (it imports sglang for it)
        sys.argv = ["sglang_router.launch_router", *argv]
        runpy.run_module("sglang_router.launch_router", run_name="__main__", alter_sys=True)
        return
    import setproctitle
    from sglang_router.router import Router
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(prog="python -m slime.rollout.sglang_router_main")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    router_args = RouterArgs.from_cli_args(parser.parse_args(argv), use_router_prefix=False)
    setproctitle.setproctitle("sglang::router")  # the name launch_router gives its process
    router_args._validate_router_args()  # what launch_router checks before it starts the Rust router
    Router.from_args(router_args).start()  # blocks until the router is shut down


if __name__ == "__main__":
    main(sys.argv[1:])
