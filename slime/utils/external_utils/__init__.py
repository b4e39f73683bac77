"""Upstream slime's launch helpers for example and end-to-end scripts (not used by the framework itself):
`command_utils` builds and runs the train.py / converter / download commands, `typer_utils` turns a dataclass of
script options into a typer command line."""
