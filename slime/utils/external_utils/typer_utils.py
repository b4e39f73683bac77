"""`dataclass_cli`: upstream's decorator that exposes a function taking one dataclass of options as a typer command
whose options are the dataclass fields, each also read from SLIME_SCRIPT_<FIELD> in the environment."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Annotated, Any, Callable


def dataclass_cli(func: Callable[[Any], Any], env_var_prefix: str = "SLIME_SCRIPT_") -> Callable[..., Any]:
    """func(options) -> a function of keyword arguments named after the dataclass fields (the signature typer
    reads: one option per field, defaults kept, envvar PREFIX + FIELD upper-cased) that builds the dataclass,
    prints it and calls func."""
    try:
        import typer
    except ImportError as e:
        raise ImportError("dataclass_cli needs typer (pip install typer)") from e

    first = next(iter(inspect.signature(func).parameters.values()), None)
    options_cls = first.annotation if first is not None else None
    if isinstance(options_cls, str):  # postponed annotations (from __future__ import annotations)
        options_cls = typing.get_type_hints(func).get(first.name)
    if options_cls is None or not dataclasses.is_dataclass(options_cls):
        raise TypeError(f"dataclass_cli: the first parameter of {func.__qualname__} must be annotated with a dataclass")
    field_types = typing.get_type_hints(options_cls)
    parameters = [
        param.replace(annotation=Annotated[field_types.get(name, param.annotation),
                                           typer.Option(envvar=f"{env_var_prefix}{name.upper()}")])
        for name, param in inspect.signature(options_cls).parameters.items()
    ]

    def from_options(**kwargs: Any) -> Any:
        options = options_cls(**kwargs)
        print(f"Execute command with args: {options}")
        return func(options)

    from_options.__signature__ = inspect.Signature(parameters)
    from_options.__doc__, from_options.__name__, from_options.__qualname__ = func.__doc__, func.__name__, func.__qualname__
    return from_options
