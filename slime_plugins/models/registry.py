"""The model registry: HF `model_type` -> the model family that implements it on Megatron-core.

Each folder `slime_plugins/models/<family>/` exposes one `FAMILY = ModelFamily(...)` in its `__init__.py`;
the registry imports every such folder on first use and indexes the families by the `model_type`s they
serve. The trainer, the HF loader / exporter and the argument checks never import a family by name:

    family = get_family(config["model_type"])     # UnsupportedModelError (one line) when none serves it
    arch = family.parse_config(config)            # the family's architecture dataclass (no megatron import)
    model = family.build_model(arch, tp, ep, pp, dtype=..., gather_logits=..., mtp=...)
    maps = family.weight_maps(model)              # HF name <-> parameter, with its TP / EP split kind

Out-of-tree families: `register_family(FAMILY)`, or list their modules in `SLIME_MODEL_PLUGINS`
(comma-separated module paths, each defining `FAMILY`).

Importing this module imports no megatron-core and no family: `supported_model_types()` is cheap enough
for command-line validation.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable

PLUGINS_ENV = "SLIME_MODEL_PLUGINS"
_SKIP = {"common"}  # shared building blocks, not a family


class UnsupportedModelError(ValueError):
    """A checkpoint whose architecture no registered family implements (or a config a family rejects)."""


def _resolve(path: str) -> Callable:
    module, _, attr = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class ModelFamily:
    """What slime needs to train, export and serve one model family. Callables given as "module:attr"
    strings are imported on first call, so declaring a family imports neither megatron-core nor torch."""

    name: str  # the folder name, e.g. "qwen3"
    model_types: tuple[str, ...]  # HF config.json `model_type`s it serves
    parse_config: str  # (config.json dict) -> architecture dataclass; raises UnsupportedModelError
    build_model: str  # (arch, tp, ep, pp, dtype=, gather_logits=, mtp=, **config_overrides) -> this rank's model
    weight_maps: str  # (model) -> list[WeightMap] of this rank's shard
    hf_names: str  # (arch) -> every HF tensor name of the main model (no MTP), in export order
    mtp_names: str | None = None  # (arch) -> (MTP HF names, {alias name: main name}); None: no MTP training
    tiny_config: str | None = None  # (model_type, **overrides) -> transformers config of a tiny test model
    transformers_class: str = ""  # the transformers class the embedded engine and the tests run
    engines: tuple[str, ...] = ("embedded", "sglang")  # rollout engines that serve this family
    description: str = ""

    def call(self, field: str, *args, **kwargs):
        fn = getattr(self, field)
        if fn is None:
            raise UnsupportedModelError(f"model family {self.name!r} has no {field}")
        return _resolve(fn)(*args, **kwargs)

    def parse(self, config: dict) -> Any:
        return self.call("parse_config", config)

    @property
    def supports_mtp(self) -> bool:
        return self.mtp_names is not None


_FAMILIES: dict[str, ModelFamily] = {}  # model_type -> family
_DISCOVERED = False


def register_family(family: ModelFamily) -> None:
    """Add a family; a model_type served by another family already is an error (one line)."""
    for t in family.model_types:
        other = _FAMILIES.get(t)
        if other is not None and other.name != family.name:
            raise ValueError(f"model_type {t!r} is claimed by both model families {other.name!r} and {family.name!r}")
    for t in family.model_types:
        _FAMILIES[t] = family


def _discover() -> None:
    global _DISCOVERED
    if _DISCOVERED:
        return
    _DISCOVERED = True
    import slime_plugins.models as pkg

    modules = [f"{pkg.__name__}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__) if m.ispkg and m.name not in _SKIP]
    modules += [m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()]
    for name in modules:
        family = getattr(importlib.import_module(name), "FAMILY", None)
        if family is None:
            if name.startswith(pkg.__name__ + "."):
                continue  # a helper package without a family
            raise ValueError(f"{PLUGINS_ENV}: module {name!r} defines no FAMILY = ModelFamily(...)")
        register_family(family)


def families() -> list[ModelFamily]:
    """Every registered family, once each, by name."""
    _discover()
    return sorted({f.name: f for f in _FAMILIES.values()}.values(), key=lambda f: f.name)


def supported_model_types() -> tuple[str, ...]:
    _discover()
    return tuple(sorted(_FAMILIES))


def get_family(model_type: str | None) -> ModelFamily:
    """The family serving `model_type`; UnsupportedModelError naming the supported ones otherwise."""
    _discover()
    family = _FAMILIES.get(model_type or "")
    if family is None:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported by the Megatron backend; "
                                    f"supported: {', '.join(supported_model_types())}")
    return family


def parse_hf_config(config: dict) -> tuple[ModelFamily, Any]:
    """(family, architecture) of an HF config.json dict; UnsupportedModelError (one line) on any problem,
    a missing key included."""
    family = get_family(config.get("model_type"))
    try:
        return family, family.parse(config)
    except KeyError as e:
        raise UnsupportedModelError(f"config.json lacks {e.args[0]!r} (needed by the {family.name} model)") from e
