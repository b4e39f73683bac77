"""slime: RL post-training (Megatron-core trainer, SGLang or the embedded rollout engine, Ray)."""

from slime import import_hooks as _import_hooks

_import_hooks.install()  # before any megatron import of this process (slime/import_hooks.py)
