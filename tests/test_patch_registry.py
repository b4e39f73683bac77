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


def test_second_patch_on_a_target_refused_unless_it_composes(victim):
    P.register_patch("testacc", "victimlib", _patch("first", ("slime_test_victim:f",)))
    with pytest.raises(P.PatchError) as info:
        P.register_patch("testacc", "victimlib", _patch("second", ("slime_test_victim:K.m", "slime_test_victim:f")))
    msg = str(info.value)
    assert "\n" not in msg and "'second'" in msg and "'first'" in msg and "slime_test_victim:f" in msg
    wrap = P.Patch(name="wraps", targets=("slime_test_victim:f",), replacement=lambda orig: (lambda: orig() + "+w"),
                   why="w", replaces="r", versions=">=0", remove_when="never", composes=True,
                   check_signature=False)
    P.register_patch("testacc", "victimlib", wrap)
    assert P.apply_patch_set("testacc", "victimlib") == ["first", "wraps"]
    assert victim.f() == "patched+w"  # in declaration order, the composing one around the first
    P.revert_patch_set("testacc", "victimlib")
    assert victim.f() == "original"


def test_patch_on_a_target_another_applied_set_replaced_is_refused(victim):
    P.register_patch("testacc", "victimlib", _patch("one", ("slime_test_victim:f",)))
    P.register_patch("otheracc", "victimlib", _patch("two", ("slime_test_victim:f",), value="other"))
    P.apply_patch_set("testacc", "victimlib")
    try:
        with pytest.raises(P.PatchError, match=r"'two'.*slime_test_victim:f.*applied patch 'one'"):
            P.apply_patch_set("otheracc", "victimlib")
        assert victim.f() == "patched" and not P.is_applied("otheracc", "victimlib")
    finally:
        P.revert_patch_set("testacc", "victimlib")
    assert P.apply_patch_set("otheracc", "victimlib") == ["two"] and victim.f() == "other"  # after the revert
    P.revert_patch_set("otheracc", "victimlib")


def test_factory_error_is_a_patch_error_naming_the_patch(victim):
    def factory(orig):
        return orig.no_such_attribute  # a bare AttributeError inside the factory

    P.register_patch("testacc", "victimlib", _patch("good", ("slime_test_victim:f",)))
    P.register_patch("testacc", "victimlib", P.Patch(name="broken", targets=("slime_test_victim:K.m",),
                                                     replacement=factory, why="w", replaces="r", versions=">=0",
                                                     remove_when="never"))
    with pytest.raises(P.PatchError) as info:
        P.apply_patch_set("testacc", "victimlib")
    msg = str(info.value)
    assert "\n" not in msg and "'broken'" in msg and "slime_test_victim:K.m" in msg and "AttributeError" in msg
    assert isinstance(info.value.__cause__, AttributeError)
    assert victim.f() == "original" and not P.is_applied("testacc", "victimlib")


def test_changed_original_source_refuses_to_apply(tmp_path, monkeypatch):
    import importlib

    src = tmp_path / "slime_test_fp_lib.py"
    src.write_text("def f(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    lib = importlib.import_module("slime_test_fp_lib")
    target = "slime_test_fp_lib:f"
    patch = P.Patch(name="rewrite_f", targets=(target,), replacement=lambda orig: (lambda x: x + 2), why="w",
                    replaces="r", versions=">=0", remove_when="never")
    P.register_patch("testacc", "fplib", patch)
    monkeypatch.setattr(P, "_FINGERPRINTS", {"fplib": {"rewrite_f": {target: P.source_fingerprint(lib.f)}}})
    try:
        P.apply_patch_set("testacc", "fplib")  # the source it was written against: applies
        assert lib.f(1) == 3
        P.revert_patch_set("testacc", "fplib")
        src.write_text("def f(x):\n    return x + 1  # upstream fixed something here\n")
        importlib.reload(lib)
        with pytest.raises(P.PatchError) as info:
            P.apply_patch_set("testacc", "fplib")
        msg = str(info.value)
        assert "\n" not in msg and "'rewrite_f'" in msg and target in msg and "changed" in msg
        assert "re-check the rewrite" in msg and "--record-fingerprints" in msg
        assert lib.f(1) == 2 and not P.is_applied("testacc", "fplib")  # nothing applied
    finally:
        P.revert_patch_set("testacc", "fplib")
        P._REGISTRY.pop(("testacc", "fplib"), None)
        sys.modules.pop("slime_test_fp_lib", None)


def test_every_declared_set_matches_its_recorded_fingerprints():
    """The installed megatron-core / transformers are the code the patches were written against."""
    from slime.accelerator.registry import accelerator_names

    fingerprints = P.recorded_fingerprints()
    checked = 0
    for name in accelerator_names():
        for library in P.declared_sets(name):
            for patch in P.patch_set(name, library):
                for target, want in fingerprints.get(library, {}).get(patch.name, {}).items():
                    if P.is_applied(name, library):
                        continue
                    _, _, original = P._resolve(patch, target, library)
                    if P.holds_replacement(patch, original):
                        continue  # replaced as the library imported (slime/import_hooks.py): nothing of its own
                    assert P.source_fingerprint(original) == want, f"{patch.name}: {target} changed"
                    checked += 1
    assert checked >= 40
    assert all(P.upstream_ref(p, "megatron") for p in P.patch_set("cpu", "megatron"))


def test_an_out_of_tree_class_declares_the_shared_megatron_set_in_one_line(monkeypatch):
    from slime.accelerator import CpuAccelerator, registry

    class Cpu3(CpuAccelerator):
        name = "cpu3"
        patch_sets = {"megatron": "slime.accelerator.megatron_patches:register_common"}

    monkeypatch.setattr(registry, "_CLASSES", dict(registry._CLASSES))
    monkeypatch.setattr(registry, "_PRIORITIES", dict(registry._PRIORITIES))
    monkeypatch.setattr(registry, "_DETECTION_ORDER", list(registry._DETECTION_ORDER))
    registry.register_accelerator(Cpu3)
    try:
        names = [p.name for p in P.patch_set("cpu3", "megatron")]
        assert names and names == [p.name for p in P.patch_set("npu", "megatron")]
        assert ("cpu3", "megatron") in P.registered_sets()
    finally:
        P._REGISTRY.pop(("cpu3", "megatron"), None)
