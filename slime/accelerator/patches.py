"""Documented patch sets: what a third-party library needs changed to run on a device.

Each `Patch` replaces named attributes (module functions, class methods, module globals)
and records why, what it replaces, which library versions it targets and when it can
be removed. Patch sets are registered per (accelerator name, library); the accelerator class
says where each of its sets is declared (`Accelerator.patch_sets`, imported on first use), its
`apply_patches(library)` applies the set once per process, and `revert_patches` restores
the originals (tests use this). No blanket device remapping: only named targets change.

Applying fails early, with one line naming the patch (`PatchError`), instead of letting the
original code break later inside the library:
- a target that does not exist is an error, unless the patch says `add_if_missing=True`;
- an installed library version outside the patch's `versions` is an error, unless
  `SLIME_ALLOW_PATCH_VERSION_MISMATCH=1` (then one warning per patch);
- a replacement function that restates the original's parameters (no `*args/**kwargs`
  pass-through) must restate them exactly: names, kinds and which have defaults;
- other bindings of a replaced module-level object (`from x import f` in another module of the
  same library) are found by sweeping `sys.modules` and replaced too, so targets list only the
  defining module;
- a second patch on a target another patch already replaces is refused, unless it declares
  `composes=True` (it wraps whatever it is given);
- an exception inside a replacement factory is a PatchError naming the patch and the target;
- the source of each replaced original is fingerprinted (patch_fingerprints.json, written by
  `python -m slime.accelerator --record-fingerprints`): a library whose code changed under a patch,
  even inside its `versions`, is refused until someone re-checks the rewrite and records the new source.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from importlib import metadata
from types import ModuleType
from typing import Any, Callable

logger = logging.getLogger(__name__)

_MISSING = object()
ALLOW_VERSION_MISMATCH_ENV = "SLIME_ALLOW_PATCH_VERSION_MISMATCH"


class PatchError(RuntimeError):
    """A patch set cannot be applied as declared (one line: the patch, the target, the fix)."""


@dataclass(frozen=True)
class Patch:
    name: str
    targets: tuple[str, ...]  # "package.module:Attr.path" places that receive the replacement
    replacement: Callable[[Any], Any]  # factory: original -> new value (None when add_if_missing adds it)
    why: str
    replaces: str  # what the original does that fails on this device
    versions: str  # PEP 440 specifier of the library this patch was written against
    remove_when: str
    library: str = ""  # distribution name checked against `versions` (filled by register)
    add_if_missing: bool = False  # the target may be absent (the patch adds it; revert deletes it again)
    check_signature: bool = True  # False only where the replacement deliberately takes other parameters
    composes: bool = False  # may go on a target another patch already replaced (it wraps what it is given)
    # The upstream issue/PR this works around, or the upstream code it replaces (as vllm-ascend's "Related
    # PR"); empty: `upstream_ref` names the replaced code in the installed library.
    upstream: str = ""

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
_LOCK = threading.RLock()

# Distribution names for `versions` checks, per library key.
LIBRARY_DISTRIBUTIONS = {"megatron": "megatron-core", "transformers": "transformers", "sglang": "sglang"}


def register_patch(accelerator: str, library: str, patch: Patch) -> Patch:
    with _LOCK:
        patches = _REGISTRY.setdefault((accelerator, library), [])
        if any(p.name == patch.name for p in patches):
            raise ValueError(f"patch {patch.name!r} already registered for {accelerator}/{library}")
        if not patch.composes:
            for other in patches:
                shared = sorted(set(other.targets) & set(patch.targets))
                if shared:
                    raise PatchError(f"patch {patch.name!r}: target {shared[0]} is already replaced by patch "
                                     f"{other.name!r} of {accelerator}/{library}; merge the two, or declare "
                                     f"{patch.name!r} composes=True if it wraps the other's replacement")
        patches.append(patch)
    return patch


# --- fingerprints of the replaced originals ----------------------------------------------------------------
FINGERPRINTS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "patch_fingerprints.json")
_FINGERPRINTS: dict[str, dict[str, dict[str, str]]] | None = None  # library -> patch -> target -> digest


def source_fingerprint(obj: Any) -> str | None:
    """sha256 (16 hex) of the source of a function, method or class; None where there is no source."""
    obj = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    obj = obj.fget if isinstance(obj, property) and obj.fget is not None else obj
    if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismethod(obj)):
        return None
    try:
        source = inspect.getsource(obj)  # follows functools.wraps' __wrapped__ to the original
    except (OSError, TypeError):
        return None
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def recorded_fingerprints() -> dict[str, dict[str, dict[str, str]]]:
    global _FINGERPRINTS
    if _FINGERPRINTS is None:
        try:
            with open(FINGERPRINTS_PATH, encoding="utf-8") as f:
                _FINGERPRINTS = json.load(f)
        except FileNotFoundError:
            _FINGERPRINTS = {}
    return _FINGERPRINTS


def holds_replacement(patch: Patch, original: Any) -> bool:
    """The target already holds what the patch puts there (slime/import_hooks.py set it as the library's
    module executed): no library source is left to fingerprint."""
    if original is _MISSING or original is None:
        return False
    try:
        return patch.replacement(original) is original
    except Exception:
        return False


def _check_fingerprint(patch: Patch, target: str, library: str, original: Any) -> None:
    want = recorded_fingerprints().get(library, {}).get(patch.name, {}).get(target)
    got = source_fingerprint(original)
    if want is None or got is None or want == got:
        return
    version = _installed_version(library)
    where = f"{LIBRARY_DISTRIBUTIONS.get(library, library)} {version}" if version else library
    raise PatchError(f"patch {patch.name!r}: the source of {target} in {where} changed since the patch was written "
                     f"(fingerprint {got}, recorded {want}); re-check the rewrite against the new code, then run "
                     f"`python -m slime.accelerator --record-fingerprints`")


def record_fingerprints(path: str | None = None) -> dict[str, dict[str, dict[str, str]]]:
    """Fingerprint the installed originals of every declared patch set (applies nothing) and write them,
    temp file then rename. Sets that cannot load here keep their recorded entries."""
    from slime.accelerator.registry import accelerator_names

    table = {lib: {name: dict(t) for name, t in patches.items()} for lib, patches in recorded_fingerprints().items()}
    for accelerator in accelerator_names():
        for library in declared_sets(accelerator):
            try:
                patches = patch_set(accelerator, library)
            except ImportError:
                continue
            if is_applied(accelerator, library):
                continue  # the installed values are the replacements
            for patch in patches:
                for target in patch.targets:
                    _, _, original = _resolve(patch, target, library)
                    digest = None if original is _MISSING or holds_replacement(patch, original) \
                        else source_fingerprint(original)
                    if digest is not None:
                        table.setdefault(library, {}).setdefault(patch.name, {})[target] = digest
    path = path or FINGERPRINTS_PATH
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(table, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    global _FINGERPRINTS
    _FINGERPRINTS = table
    return table


def upstream_ref(patch: Patch, library: str) -> str:
    """`patch.upstream`, else the replaced code: library version, file inside the library, attribute."""
    if patch.upstream:
        return patch.upstream
    version = _installed_version(library)
    dist = LIBRARY_DISTRIBUTIONS.get(library, library)
    places = []
    for target in patch.targets:
        module, attr = target.split(":", 1)
        places.append(f"{module.replace('.', '/')}.py:{attr}")
    return f"{dist} {version or '(not installed)'}: " + ", ".join(places)


def declared_sets(accelerator: str) -> dict[str, str]:
    """library -> where the registered accelerator class `accelerator` declares its set (Accelerator.patch_sets);
    {} for a name no class is registered under."""
    from slime.accelerator.registry import registered_class

    cls = registered_class(accelerator)
    return dict(cls.patch_sets) if cls is not None else {}


def registered_sets() -> list[tuple[str, str]]:
    """Every (accelerator, library) with a declared or a registered set."""
    from slime.accelerator.registry import accelerator_names

    declared = {(name, library) for name in accelerator_names() for library in declared_sets(name)}
    return sorted(declared | set(_REGISTRY))


def _load_declared(accelerator: str, library: str) -> None:
    """Import the declaration of the set (lazy: no library is imported at `import slime`)."""
    where = declared_sets(accelerator).get(library)
    if not where:
        return
    module, _, function = where.partition(":")
    loaded = importlib.import_module(module)
    if function:
        getattr(loaded, function)(accelerator)


def patch_set(accelerator: str, library: str) -> list[Patch]:
    with _LOCK:
        if (accelerator, library) not in _REGISTRY:
            _load_declared(accelerator, library)
        return list(_REGISTRY.get((accelerator, library), []))


def _installed_version(library: str) -> str | None:
    try:
        return metadata.version(LIBRARY_DISTRIBUTIONS.get(library, library))
    except metadata.PackageNotFoundError:
        return None  # not installed as a distribution (a test module): nothing to check


def check_version(patch: Patch, library: str) -> None:
    from packaging.specifiers import SpecifierSet

    version = _installed_version(library)
    if version is None or version in SpecifierSet(patch.versions, prereleases=True):
        return
    dist = LIBRARY_DISTRIBUTIONS.get(library, library)
    msg = (f"patch {patch.name!r} targets {dist} {patch.versions} but {version} is installed; install a "
           f"version in range, or update the patch (or set {ALLOW_VERSION_MISMATCH_ENV}=1 to apply it anyway)")
    if os.environ.get(ALLOW_VERSION_MISMATCH_ENV) == "1":
        logger.warning("%s; applying because %s=1", msg.split(";")[0], ALLOW_VERSION_MISMATCH_ENV)
        return
    raise PatchError(msg)


def _resolve(patch: Patch, target: str, library: str) -> tuple[Any, str, Any]:
    """(owner, attribute, original or _MISSING); a missing module/owner/attribute is a PatchError."""
    module_name, attr_path = target.split(":", 1)
    version = _installed_version(library)
    where = f"{LIBRARY_DISTRIBUTIONS.get(library, library)} {version}" if version else library

    def missing(what: str) -> PatchError:
        return PatchError(f"patch {patch.name!r}: target {target} not found ({what} missing in {where}); "
                          f"the patch no longer matches the library: update or remove it")

    try:
        owner: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise missing(f"module {e.name}") from None
    parts = attr_path.split(".")
    for i, p in enumerate(parts[:-1]):
        if not hasattr(owner, p):
            raise missing(f"{module_name}:{'.'.join(parts[: i + 1])}")
        owner = getattr(owner, p)
    attr = parts[-1]
    original = owner.__dict__.get(attr, _MISSING) if isinstance(owner, type) else getattr(owner, attr, _MISSING)
    if original is _MISSING and not patch.add_if_missing:
        raise missing(f"attribute {attr!r}")
    return owner, attr, original


def _function(obj: Any) -> Callable | None:
    obj = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    return obj if inspect.isfunction(obj) else None


def _shape(fn: Callable) -> tuple[tuple[str, Any, bool], ...] | None:
    try:
        sig = inspect.signature(fn)  # follows functools.wraps' __wrapped__
    except (TypeError, ValueError):
        return None
    return tuple((p.name, p.kind, p.default is not inspect.Parameter.empty) for p in sig.parameters.values())


def _check_signature(patch: Patch, target: str, original: Any, new: Any) -> None:
    """A replacement that spells out parameters must spell out the original's (names, kinds, defaults
    present); one taking *args/**kwargs passes everything through and is not compared."""
    orig_fn, new_fn = _function(original), _function(new)
    if not patch.check_signature or orig_fn is None or new_fn is None or orig_fn is new_fn:
        return
    want, got = _shape(orig_fn), _shape(new_fn)
    if want is None or got is None or any(kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
                                          for _, kind, _ in got):
        return
    if want != got:
        raise PatchError(
            f"patch {patch.name!r}: replacement for {target} takes {inspect.signature(new_fn)} but the installed "
            f"original takes {inspect.signature(orig_fn)}; update the replacement to the library's signature"
        )


def _aliases(owner: Any, attr: str, original: Any) -> list[tuple[Any, str]]:
    """Other module-level bindings of `original` in the same top-level package (e.g. `from .a import f`)."""
    if not isinstance(owner, ModuleType) or original is _MISSING or original is None \
            or isinstance(original, (bool, int, float, str, bytes)):
        return []
    package = owner.__name__.split(".")[0] + "."
    found = []
    for name, mod in list(sys.modules.items()):
        if mod is None or mod is owner or not (name + ".").startswith(package):
            continue
        try:
            items = list(vars(mod).items())
        except TypeError:
            continue
        found.extend((mod, key) for key, value in items if value is original)
    return found


def _installed_by(owner: Any, attr: str, value: Any) -> str | None:
    """Name of the applied patch whose replacement sits at owner.attr now, if any."""
    if value is _MISSING:
        return None
    for records in _APPLIED.values():
        for record in records:
            for o, a, _ in record.originals:
                if o is owner and a == attr:
                    return record.patch.name
    return None


def is_applied(accelerator: str, library: str) -> bool:
    return (accelerator, library) in _APPLIED


def apply_patch_set(accelerator: str, library: str) -> list[str]:
    """Apply once per process; a second call is a no-op. All-or-nothing: a failing patch reverts the set."""
    with _LOCK:
        key = (accelerator, library)
        if key in _APPLIED:
            return [a.patch.name for a in _APPLIED[key]]
        applied: list[_Applied] = []
        patches = patch_set(accelerator, library)
        for patch in patches:
            check_version(patch, library)
        # Resolve (import) every target first: a module imported part-way through applying would
        # bind an already-patched function and record it as the "original".
        resolved = {(patch.name, t): _resolve(patch, t, library) for patch in patches for t in patch.targets}
        try:
            for patch in patches:
                record = _Applied(patch)
                applied.append(record)
                done: set[tuple[int, str]] = set()
                for target in patch.targets:
                    owner, attr, original = resolved[(patch.name, target)]
                    if (id(owner), attr) in done:
                        continue
                    if patch.composes:  # wraps what is there now: an earlier patch of this set may have replaced it
                        original = owner.__dict__.get(attr, _MISSING) if isinstance(owner, type) \
                            else getattr(owner, attr, _MISSING)
                    holder = _installed_by(owner, attr, original)
                    if holder is not None and holder != patch.name and not patch.composes:
                        raise PatchError(f"patch {patch.name!r}: target {target} is already replaced by applied patch "
                                         f"{holder!r}; revert that set first, or declare {patch.name!r} "
                                         f"composes=True if it wraps the other's replacement")
                    if holder is None and original is not _MISSING and not holds_replacement(patch, original):
                        _check_fingerprint(patch, target, library, original)
                    try:
                        new = patch.replacement(None if original is _MISSING else original)
                    except Exception as e:
                        raise PatchError(f"patch {patch.name!r}: its replacement factory for {target} failed "
                                         f"({type(e).__name__}: {e}); fix the patch or the library version") from e
                    _check_signature(patch, target, original, new)
                    for o, a in [(owner, attr), *_aliases(owner, attr, original)]:
                        if (id(o), a) in done:
                            continue
                        done.add((id(o), a))
                        record.originals.append((o, a, o.__dict__.get(a, _MISSING) if isinstance(o, type)
                                                 else getattr(o, a, _MISSING)))
                        setattr(o, a, new)
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


def applied_bindings(accelerator: str, library: str) -> list[tuple[str, str]]:
    """(patch name, "module:attr") for every binding an applied set replaced, aliases included."""
    out = []
    for record in _APPLIED.get((accelerator, library), []):
        for owner, attr, _ in record.originals:
            where = owner.__name__ if isinstance(owner, ModuleType) else f"{owner.__module__}:{owner.__qualname__}"
            out.append((record.patch.name, f"{where}:{attr}" if isinstance(owner, ModuleType) else f"{where}.{attr}"))
    return out
