"""The documented patch registry: record format, apply once, revert, all-or-nothing."""

from __future__ import annotations

import sys
import types

import pytest

from slime.accelerator import patches as P


@pytest.fixture
def victim(monkeypatch):
    mod = types.ModuleType("slime_test_victim")
    mod.f = lambda: "original"

    class K:
        def m(self):
            return "original"

    mod.K = K
    monkeypatch.setitem(sys.modules, "slime_test_victim", mod)
    yield mod
    for key in [k for k in P._REGISTRY if k[1] == "victimlib"]:
        P._REGISTRY.pop(key, None)
        P._APPLIED.pop(key, None)


def _patch(name, targets, value="patched", **kw):
    fields = dict(why="w", replaces="r", versions=">=0", remove_when="never", check_signature=False)
    fields.update(kw)
    return P.Patch(name=name, targets=targets, replacement=lambda orig: (lambda *a: value), **fields)


def test_record_requires_documentation():
    with pytest.raises(ValueError, match="why"):
        _patch("p", ("m:f",), why=" ")
    with pytest.raises(ValueError, match="module:attr"):
        _patch("p", ("no_colon",))


def test_apply_once_and_revert(victim):
    P.register_patch("testacc", "victimlib", _patch("f-and-method", ("slime_test_victim:f", "slime_test_victim:K.m")))
    assert P.apply_patch_set("testacc", "victimlib") == ["f-and-method"]
    assert victim.f() == "patched" and victim.K().m() == "patched"
    assert P.apply_patch_set("testacc", "victimlib") == ["f-and-method"]  # idempotent
    P.revert_patch_set("testacc", "victimlib")
    assert victim.f() == "original" and victim.K().m() == "original"
    assert not P.is_applied("testacc", "victimlib")


def test_failing_patch_reverts_whole_set(victim):
    def boom(orig):
        raise RuntimeError("replacement factory failed")

    P.register_patch("testacc", "victimlib", _patch("good", ("slime_test_victim:f",)))
    P.register_patch("testacc", "victimlib", P.Patch(name="bad", targets=("slime_test_victim:K.m",), replacement=boom,
                                                     why="w", replaces="r", versions=">=0", remove_when="never"))
    with pytest.raises(RuntimeError, match="factory failed"):
        P.apply_patch_set("testacc", "victimlib")
    assert victim.f() == "original"
    assert not P.is_applied("testacc", "victimlib")


@pytest.mark.parametrize("target, what", [
    ("slime_test_victim:gone", "attribute 'gone'"),
    ("slime_test_victim:Missing.attr", "slime_test_victim:Missing"),
    ("slime_test_no_such_module:f", "module slime_test_no_such_module"),
])
def test_missing_target_is_one_line_error_naming_patch_and_target(victim, target, what):
    P.register_patch("testacc", "victimlib", _patch("good", ("slime_test_victim:f",)))
    P.register_patch("testacc", "victimlib", _patch("stale", (target,)))
    with pytest.raises(P.PatchError) as info:
        P.apply_patch_set("testacc", "victimlib")
    msg = str(info.value)
    assert "\n" not in msg and "'stale'" in msg and target in msg and what in msg
    assert victim.f() == "original" and not P.is_applied("testacc", "victimlib")  # nothing applied


def test_add_if_missing_adds_and_revert_removes(victim):
    P.register_patch("testacc", "victimlib", _patch("adds", ("slime_test_victim:brand_new",), add_if_missing=True))
    P.apply_patch_set("testacc", "victimlib")
    assert victim.brand_new() == "patched"
    P.revert_patch_set("testacc", "victimlib")
    assert not hasattr(victim, "brand_new")


def test_version_outside_range_fails_unless_allowed(victim, monkeypatch):
    monkeypatch.setitem(P.LIBRARY_DISTRIBUTIONS, "victimlib", "pytest")  # an installed distribution
    version = P.metadata.version("pytest")
    P.register_patch("testacc", "victimlib", _patch("old", ("slime_test_victim:f",), versions="<1"))
    monkeypatch.delenv(P.ALLOW_VERSION_MISMATCH_ENV, raising=False)
    with pytest.raises(P.PatchError) as info:
        P.apply_patch_set("testacc", "victimlib")
    msg = str(info.value)
    assert "'old'" in msg and version in msg and "<1" in msg and P.ALLOW_VERSION_MISMATCH_ENV in msg
    assert victim.f() == "original"
    monkeypatch.setenv(P.ALLOW_VERSION_MISMATCH_ENV, "1")
    assert P.apply_patch_set("testacc", "victimlib") == ["old"] and victim.f() == "patched"


def test_restated_signature_is_compared_with_the_original(victim):
    victim.g = lambda a, b=1: "original"

    def make(fn):
        return P.Patch(name="sig", targets=("slime_test_victim:g",), replacement=lambda orig: fn, why="w",
                       replaces="r", versions=">=0", remove_when="never")

    P.register_patch("testacc", "victimlib", make(lambda a, c=1: "renamed"))
    with pytest.raises(P.PatchError, match=r"'sig'.*slime_test_victim:g.*\(a, c=1\).*\(a, b=1\)"):
        P.apply_patch_set("testacc", "victimlib")
    P._REGISTRY.pop(("testacc", "victimlib"))
    P.register_patch("testacc", "victimlib", make(lambda a, b=2: "same shape"))  # default values may differ
    P.apply_patch_set("testacc", "victimlib")
    assert victim.g(0) == "same shape"
    P.revert_patch_set("testacc", "victimlib")
    P._REGISTRY.pop(("testacc", "victimlib"))
    P.register_patch("testacc", "victimlib", make(lambda *a, **k: "pass-through"))  # not compared
    P.apply_patch_set("testacc", "victimlib")
    assert victim.g(0) == "pass-through"


def test_aliases_are_found_by_sweeping_sys_modules(victim, monkeypatch):
    user = types.ModuleType("slime_test_victim.user")
    user.f_alias = victim.f  # `from slime_test_victim import f as f_alias`
    user.unrelated = lambda: "unrelated"
    other_pkg = types.ModuleType("slime_test_other")
    other_pkg.f = victim.f  # another package: left alone
    monkeypatch.setitem(sys.modules, "slime_test_victim.user", user)
    monkeypatch.setitem(sys.modules, "slime_test_other", other_pkg)
    P.register_patch("testacc", "victimlib", _patch("f", ("slime_test_victim:f",)))
    P.apply_patch_set("testacc", "victimlib")
    assert user.f_alias() == "patched" and user.unrelated() == "unrelated" and other_pkg.f() == "original"
    assert ("f", "slime_test_victim.user:f_alias") in P.applied_bindings("testacc", "victimlib")
    P.revert_patch_set("testacc", "victimlib")
    assert user.f_alias() == "original"


def test_duplicate_names_rejected(victim):
    P.register_patch("testacc", "victimlib", _patch("dup", ("slime_test_victim:f",)))
    with pytest.raises(ValueError, match="already registered"):
        P.register_patch("testacc", "victimlib", _patch("dup", ("slime_test_victim:f",)))
