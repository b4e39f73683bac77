"""slime: RL post-training (Megatron-core trainer, SGLang or the embedded rollout engine, Ray)."""

from slime import import_hooks as _import_hooks

_import_hooks.install()  # before any megatron import of this process (slime/import_hooks.py)

from slime.utils import warning_filters as _warning_filters  # noqa: E402

_warning_filters.install()  # known-harmless library warnings (slime/utils/warning_filters.py)

from slime.utils import stack_dump as _stack_dump  # noqa: E402

_stack_dump.arm_from_env()  # SLIME_DUMP_STACKS_AFTER_S: every process prints its stacks once (hang diagnosis)
