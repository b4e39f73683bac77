"""SGLang rollout engines: the `sglang.launch_server` command line and environment for the current
accelerator, and the child-process wrapper shared with the embedded engine. SGLang itself is never
imported here (it may not be installed)."""

from slime.backends.sglang.launcher import SGLangLaunchSpec, sglang_command, sglang_env, sglang_available
from slime.backends.sglang.process import EngineStartError, ServerProcess

__all__ = ["EngineStartError", "SGLangLaunchSpec", "ServerProcess", "sglang_available", "sglang_command", "sglang_env"]
