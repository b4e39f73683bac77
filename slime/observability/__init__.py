"""Upstream slime's `slime.observability` module paths that plugins import, over this project's metrics."""
