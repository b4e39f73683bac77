"""--manual-gc: the trainer's collection points (upstream: collector off, a full collection at each train call;
Megatron: one every --manual-gc-interval optimizer steps), and the flag's parsing and checks."""

from __future__ import annotations

import gc

import pytest

from slime.backends.megatron import manual_gc as mgc
from slime.backends.megatron.manual_gc import ManualGC


@pytest.fixture
def collections(monkeypatch):
    """Counts full collections made through the module (the real collector state is restored after)."""
    calls = []
    monkeypatch.setattr(mgc.gc, "collect", lambda *a: calls.append(a) or 0)
    was_enabled = gc.isenabled()
    yield calls
    (gc.enable if was_enabled else gc.disable)()


def test_disabled_changes_nothing(collections):
    gc.enable()
    points = ManualGC(enabled=False, interval=1)
    points.train_start()
    for _ in range(3):
        points.after_step()
    assert gc.isenabled() and collections == []


def test_enabled_turns_the_collector_off_and_collects_at_each_train_call_and_every_interval(collections):
    gc.enable()
    points = ManualGC(enabled=True, interval=2)
    points.train_start()
    assert not gc.isenabled() and len(collections) == 1
    for _ in range(5):
        points.after_step()
    assert len(collections) == 1 + 2  # steps 2 and 4
    points.train_start()  # the next rollout's train call: the step count goes on across calls
    points.after_step()
    assert len(collections) == 2 + 3  # the call's own + step 6


def test_interval_zero_collects_only_at_train_calls(collections):
    points = ManualGC(enabled=True, interval=0)
    points.train_start()
    for _ in range(4):
        points.after_step()
    assert len(collections) == 1


def test_flags_parse_and_a_negative_interval_is_one_error_line(tmp_path, capsys):
    from slime.config.arguments import parse_args

    base = ["--hf-checkpoint", str(tmp_path), "--num-rollout", "3", "--global-batch-size", "8"]
    args = parse_args(base + ["--manual-gc", "--manual-gc-interval", "4", "--no-manual-gc-eval"])
    points = ManualGC.from_args(args)
    assert (points.enabled, points.interval, args.manual_gc_eval) == (True, 4, False)
    assert ManualGC.from_args(parse_args(base)).enabled is False
    with pytest.raises(SystemExit) as e:
        parse_args(base + ["--manual-gc", "--manual-gc-interval", "-1"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "--manual-gc-interval must be >= 0, got -1" in err and "\n" not in err
    with pytest.raises(ValueError, match="--manual-gc-interval must be >= 0"):
        ManualGC(enabled=True, interval=-3)
