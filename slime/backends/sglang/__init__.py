"""SGLang rollout engines: the `sglang.launch_server` command line and environment for the current
accelerator (launcher.py), and the child-process wrapper shared with the embedded engine
(process.py). SGLang itself is never imported here (it may not be installed). Nothing is imported
eagerly: guard.py runs as `python -m` in front of every engine server and must start fast."""
