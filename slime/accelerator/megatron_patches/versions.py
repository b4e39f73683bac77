"""The megatron-core versions every patch set of this package targets (a leaf: the topic modules import it,
and the package imports them)."""

MEGATRON_VERSIONS = ">=0.16,<0.17"
