"""Documented patch sets: what a third-party library needs changed to run on a device.

Each `Patch` replaces named attributes (module functions, class methods, module globals)
and records why, what it replaces, which library versions it targets and when it can
be removed. Patch sets are registered per (accelerator name, library); an accelerator's
`apply_patches(library)` applies its set once per process, and `revert_patches` restores
the originals (tests use this). No blanket device remapping: only named targets change.
"""

from __future__ import annotations

import importlib
import logging
import threading
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable

logger = logging.getLogger(__name__)

_MISSING = object()


@dataclass(frozen=True)
class Patch:
    name: str
    targets: tuple[str, ...]  # "package.module:Attr.path" places that receive the replacement
    replacement: Callable[[Any], Any]  # factory: original -> new value (the original may be _MISSING-wrapped None)
    why: str
    replaces: str  # what the original does that fails on this device
    versions: str  # PEP 440 specifier of the library this patch was written against
    remove_when: str
    library: str = ""  # distribution name checked against `versions` (filled by register)

    def __post_init__(self) -> None:
        for field_name in ("name", "why", "replaces", "versions", "remove_when"):
            if not str(getattr(self, field_name)).strip():
                raise ValueError(f"patch {self.name!r}: field {field_name!r} must be documented")
        for t in self.targets:
            if ":" not in t:
                raise ValueError(f"patch {self.name!r}: target {t!r} must look like 'module:attr'")


@dataclass
class _Applied:
    patch: Patch
    originals: list[tuple[Any, str, Any]] = field(default_factory=list)  # (owner, attr, original)


_REGISTRY: dict[tuple[str, str], list[Patch]] = {}
_APPLIED: dict[tuple[str, str], list[_Applied]] = {}
_LOADERS: dict[tuple[str, str], Callable[[], None]] = {}
_LOCK = threading.RLock()

# Distribution names for `versions` checks, per library key.
LIBRARY_DISTRIBUTIONS = {"megatron": "megatron-core", "transformers": "transformers", "sglang": "sglang"}


def register_patch(accelerator: str, library: str, patch: Patch) -> Patch:
    with _LOCK:
        patches = _REGISTRY.setdefault((accelerator, library), [])
        if any(p.name == patch.name for p in patches):
            raise ValueError(f"patch {patch.name!r} already registered for {accelerator}/{library}")
        patches.append(patch)
    return patch


def register_patch_loader(accelerator: str, library: str, loader: Callable[[], None]) -> None:
    """A function that imports the module defining a patch set (lazy: no library import at slime import)."""
    _LOADERS[(accelerator, library)] = loader


def patch_set(accelerator: str, library: str) -> list[Patch]:
    with _LOCK:
        loader = _LOADERS.get((accelerator, library))
        if loader is not None and (accelerator, library) not in _REGISTRY:
            loader()
        return list(_REGISTRY.get((accelerator, library), []))


def _resolve(target: str) -> tuple[Any, str]:
    module_name, attr_path = target.split(":", 1)
    owner: Any = importlib.import_module(module_name)
    parts = attr_path.split(".")
    for p in parts[:-1]:
        owner = getattr(owner, p)
    return owner, parts[-1]


def _version_ok(patch: Patch, library: str) -> bool:
    dist = LIBRARY_DISTRIBUTIONS.get(library, library)
    try:
        from packaging.specifiers import SpecifierSet

        version = metadata.version(dist)
        return version in SpecifierSet(patch.versions, prereleases=True)
    except Exception:
        return True  # library not installed as a distribution (or no packaging): nothing to check


def is_applied(accelerator: str, library: str) -> bool:
    return (accelerator, library) in _APPLIED


def apply_patch_set(accelerator: str, library: str) -> list[str]:
    """Apply once per process; a second call is a no-op. All-or-nothing: a failing target reverts the set."""
    with _LOCK:
        key = (accelerator, library)
        if key in _APPLIED:
            return [a.patch.name for a in _APPLIED[key]]
        applied: list[_Applied] = []
        patches = patch_set(accelerator, library)
        # Resolve (import) every target first: a module imported part-way through applying would
        # bind an already-patched function and record it as the "original".
        resolved = {t: _resolve(t) for patch in patches for t in patch.targets}
        try:
            for patch in patches:
                if not _version_ok(patch, library):
                    logger.warning(
                        "patch %s targets %s %s; installed version differs, applying anyway (check it still applies)",
                        patch.name, library, patch.versions,
                    )
                record = _Applied(patch)
                applied.append(record)
                for target in patch.targets:
                    owner, attr = resolved[target]
                    original = owner.__dict__.get(attr, _MISSING) if isinstance(owner, type) else getattr(owner, attr, _MISSING)
                    new = patch.replacement(None if original is _MISSING else original)
                    record.originals.append((owner, attr, original))
                    setattr(owner, attr, new)
        except Exception:
            _revert(applied)
            raise
        _APPLIED[key] = applied
        if applied:
            logger.info("applied %d %s patches for %s: %s", len(applied), library, accelerator,
                        ", ".join(a.patch.name for a in applied))
        return [a.patch.name for a in applied]


def _revert(applied: list[_Applied]) -> None:
    for record in reversed(applied):
        for owner, attr, original in reversed(record.originals):
            if original is _MISSING:
                try:
                    delattr(owner, attr)
                except AttributeError:
                    pass
            else:
                setattr(owner, attr, original)


def revert_patch_set(accelerator: str, library: str) -> None:
    with _LOCK:
        applied = _APPLIED.pop((accelerator, library), None)
        if applied:
            _revert(applied)
