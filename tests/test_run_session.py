"""The run session's structure and its save schedule, without Ray: the loops (slime/run/synchronous.py,
one_step_off.py, rollout_only.py) are imported only by the entry points, and a checkpoint is written whenever
one is due, with or without a data source (the whole loops run in tests/test_e2e.py, test_train_async.py,
test_debug_modes.py)."""

from __future__ import annotations

import ast
import os
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOPS = {"slime.run.synchronous", "slime.run.one_step_off", "slime.run.rollout_only"}
ENTRY_POINTS = {"slime/train.py", "slime/train_async.py"}


def _imported_modules(path: str) -> set[str]:
    """Every module an import names, at any level (function bodies included), `from a import b` as a and a.b."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_only_the_entry_points_import_a_loop():
    importers = {}
    for root in ("slime", "slime_plugins"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, root)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT).replace(os.sep, "/")
                    loops = _imported_modules(os.path.join(ROOT, rel)) & LOOPS
                    if loops:
                        importers[rel] = loops
    assert set(importers) == ENTRY_POINTS, importers  # not the session, the launcher or another loop
    assert importers["slime/train.py"] == {"slime.run.synchronous", "slime.run.rollout_only"}
    assert importers["slime/train_async.py"] == {"slime.run.one_step_off", "slime.run.rollout_only"}


class _Remote:
    def __init__(self, fn):
        self.remote = fn


def _session(monkeypatch, data_state, **flags):
    import ray

    from slime.run.session import RunSession

    monkeypatch.setattr(ray, "get", lambda ref, **kw: ref)  # the stand-ins below answer directly
    saved = []
    args = types.SimpleNamespace(**{"save": "/ckpt", "save_interval": 3, "num_rollout": 8, **flags})
    rollout = types.SimpleNamespace(state=_Remote(lambda: data_state))
    actor = types.SimpleNamespace(save=lambda rollout_id, extra: saved.append((rollout_id, extra)) or {"time/save": 1.0})
    return RunSession(args, slots=None, actor=actor, rollout=rollout), saved


def test_a_checkpoint_is_written_whenever_due_with_the_data_position_read_at_the_save_point(monkeypatch):
    for data_state in ({"epoch": 1, "offset": 24}, None):  # None: no data source (rollouts replayed from files)
        session, saved = _session(monkeypatch, data_state)
        for rollout_id in range(8):
            metrics = {}
            session.save(session.save_point(rollout_id), metrics)
            assert metrics["time/save"] == (1.0 if rollout_id in (2, 5, 7) else 0.0)
        # every --save-interval rollouts and after the last
        assert saved == [(k, {"data_source": data_state, "rollout_id": k}) for k in (2, 5, 7)]


def test_no_checkpoint_without_save_and_only_the_last_without_an_interval(monkeypatch):
    session, saved = _session(monkeypatch, {}, save=None)
    assert [session.save_point(k) for k in range(8)] == [None] * 8
    session, saved = _session(monkeypatch, {}, save_interval=None)
    assert [k for k in range(8) if session.save_point(k) is not None] == [7]
