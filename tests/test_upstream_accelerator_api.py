"""Upstream's `slime.utils.accelerator` API over slime.accelerator: the same detection (a view of the project's
accelerator), the module-level shims, upstream's registration (both kinds of factory), MUSA refused."""

from __future__ import annotations

import pytest
import torch

import slime.accelerator as project
import slime.utils.accelerator as upstream_api
from slime.accelerator import registry
from slime.accelerator.cpu import CpuAccelerator
from slime.accelerator.upstream_api import _REGISTRY


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv("SLIME_ACCELERATOR", raising=False)
    upstream_api.reset_accelerator()
    yield
    upstream_api.reset_accelerator()


class UpstreamStyleBackend:
    """A backend of upstream's kind (its member names, no slime.accelerator base)."""
    name = device_type = "fakedev"

    def is_available(self):
        return True

    def communication_backend(self, default="nccl"):
        return "fakeccl"


def test_view_is_the_projects_accelerator_with_upstreams_names():
    view = upstream_api.get_accelerator()
    acc = project.get_accelerator()
    assert view.accelerator is acc and upstream_api.device_type() == acc.device_type
    assert upstream_api.device() == acc.device() and upstream_api.device_count() == acc.device_count()
    assert upstream_api.process_group_backend() == acc.dist_backend == upstream_api.weight_update_backend()
    assert upstream_api.process_group_backend("gloo") == "gloo"  # upstream's rule: only "nccl" is mapped
    free, total = upstream_api.mem_get_info()
    assert 0 < free <= total and upstream_api.memory_allocated() > 0
    upstream_api.manual_seed(3)
    state = upstream_api.get_rng_state()
    first = torch.rand(3)
    upstream_api.set_rng_state(state)
    assert torch.equal(torch.rand(3), first)
    assert upstream_api.supports("bf16") == acc.capabilities.bf16 and not upstream_api.supports("no_such")


def test_resolve_visible_device_id_is_upstreams_rule(monkeypatch):
    class Acc(CpuAccelerator):
        visible_devices_env = "SLIME_TEST_VISIBLE"

    view = upstream_api.AcceleratorView(Acc())
    assert view.resolve_visible_device_id("2.0") == 2  # no variable: the id itself
    monkeypatch.setenv("SLIME_TEST_VISIBLE", "4,5,6")
    assert [view.resolve_visible_device_id(x) for x in ("5", 6, 6.0, "1")] == [1, 2, 2, 1]
    with pytest.raises(RuntimeError, match=r"Device id 9 is not valid under SLIME_TEST_VISIBLE=4,5,6"):
        view.resolve_visible_device_id(9)


def test_upstream_style_backend_chosen_by_priority_or_name(monkeypatch):
    try:
        upstream_api.register_accelerator("fakedev", UpstreamStyleBackend, priority=50,
                                          communication_backends=("fakeccl",))
        assert isinstance(upstream_api.get_accelerator(), upstream_api.AcceleratorView)  # below upstream's cuda
        assert upstream_api.is_accelerator_backend("cpu:gloo,fakedev:fakeccl")
        monkeypatch.setenv("SLIME_ACCELERATOR", "fakedev")
        upstream_api.reset_accelerator()
        assert isinstance(upstream_api.get_accelerator(), UpstreamStyleBackend)
        monkeypatch.delenv("SLIME_ACCELERATOR")
        upstream_api.register_accelerator("fakedev", UpstreamStyleBackend, priority=150)
        upstream_api.reset_accelerator()
        assert upstream_api.process_group_backend() == "fakeccl"
    finally:
        _REGISTRY.pop("fakedev", None)
    with pytest.raises(ValueError, match="non-empty backend name"):
        upstream_api.register_accelerator("auto", UpstreamStyleBackend)


def test_project_class_joins_the_one_registry():
    class FaceCpu(CpuAccelerator):
        name = "facecpu"

    try:
        upstream_api.register_accelerator("facecpu", FaceCpu, priority=0)  # below upstream's cuda (100)
        order = project.accelerator_names()
        assert order.index("cuda") < order.index("facecpu") < order.index("cpu")
        assert project.accelerator_class("facecpu") is FaceCpu
    finally:
        registry._CLASSES.pop("facecpu", None)
        registry._PRIORITIES.pop("facecpu", None)
        registry._DETECTION_ORDER.remove("facecpu")
    with pytest.raises(ValueError, match="register it under that name"):
        upstream_api.register_accelerator("other", FaceCpu)


def test_musa_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("SLIME_ACCELERATOR", "musa")
    with pytest.raises(RuntimeError) as e:
        upstream_api.get_accelerator()
    assert "MUSA is not supported" in str(e.value) and "\n" not in str(e.value)
    assert upstream_api.is_musa_environment() and not upstream_api.is_musa_available()
