"""checkpoint._no_forced_collection: the full gc.collect() that megatron's distributed optimizer runs inside
sharded_state_dict (fully_reshardable) is skipped while the collector runs by itself, and kept while it is
disabled; the optimizer module's `gc` is the real module again afterwards, also after an exception."""

from __future__ import annotations

import gc
import importlib

import pytest

from slime.backends.megatron.checkpoint import torch_dist as C


def _cycle() -> None:
    a: list = []
    a.append(a)


@pytest.fixture
def distrib_optimizer():
    module = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    assert module.gc is gc
    yield module
    assert module.gc is gc


def test_collection_skipped_while_the_collector_runs(distrib_optimizer):
    assert gc.isenabled()
    with C._no_forced_collection():
        _cycle()
        assert distrib_optimizer.gc is not gc
        assert distrib_optimizer.gc.collect() == 0  # nothing collected: the pass did not run
        assert distrib_optimizer.gc.isenabled() and distrib_optimizer.gc.get_count() is not None  # the rest is gc's
    with pytest.raises(RuntimeError, match="inside"), C._no_forced_collection():
        raise RuntimeError("inside")


def test_collection_kept_with_the_collector_disabled(distrib_optimizer):
    gc.collect()
    gc.disable()
    try:
        with C._no_forced_collection():
            assert distrib_optimizer.gc is gc
            _cycle()
            assert distrib_optimizer.gc.collect() >= 1  # the cycle above
    finally:
        gc.enable()
