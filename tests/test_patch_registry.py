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
    fields = dict(why="w", replaces="r", versions=">=0", remove_when="never")
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


def test_failing_target_reverts_whole_set(victim):
    P.register_patch("testacc", "victimlib", _patch("good", ("slime_test_victim:f",)))
    P.register_patch("testacc", "victimlib", _patch("bad", ("slime_test_victim:Missing.attr",)))
    with pytest.raises(AttributeError):
        P.apply_patch_set("testacc", "victimlib")
    assert victim.f() == "original"
    assert not P.is_applied("testacc", "victimlib")


def test_new_attribute_is_removed_on_revert(victim):
    P.register_patch("testacc", "victimlib", _patch("adds", ("slime_test_victim:brand_new",)))
    P.apply_patch_set("testacc", "victimlib")
    assert victim.brand_new() == "patched"
    P.revert_patch_set("testacc", "victimlib")
    assert not hasattr(victim, "brand_new")


def test_duplicate_names_rejected(victim):
    P.register_patch("testacc", "victimlib", _patch("dup", ("slime_test_victim:f",)))
    with pytest.raises(ValueError, match="already registered"):
        P.register_patch("testacc", "victimlib", _patch("dup", ("slime_test_victim:f",)))
