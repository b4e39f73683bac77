"""--update-weight-mode disk under pipeline parallel, ranks spawned over gloo (tests/disk_sync_worker.py): at PP2 and
TP2 x PP2 each stage's sender writes its share of one checkpoint, and the embedded engine (which loaded another
checkpoint) ends up holding exactly what the single-rank sender exports, bit for bit per name; every exported name
is written once (none missing, none twice, each stage's names in its own files). A write that fails on one stage's
sender (a full disk, after its first file) publishes nothing: the engine is never asked to load, keeps the weights it
had, generation resumes, rank 0 and the failing sender raise, and the partial checkpoint is removed; the next sync succeeds."""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest
import torch
from rank_spawn import spawn

from slime.utils.net import free_port


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(the trainer's checkpoint, the engine's: the same tiny GLM-5 with other random weights)."""
    from slime_plugins.models.glm5.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("ckpts")
    return (write_tiny_checkpoint(str(root / "trainer"), seed=5), write_tiny_checkpoint(str(root / "engine"), seed=0))


def _spawn(world: int, ckpt: str, layout: dict, out_dir, engine: dict) -> dict:
    from disk_sync_worker import run

    ctx = spawn(run, args=(world, free_port(), ckpt, layout, str(out_dir), engine), nprocs=world, join=False)
    while any(p.exitcode is None for p in ctx.processes):  # the engine's server threads live in this process
        time.sleep(0.5)
    codes = [p.exitcode for p in ctx.processes]
    assert codes == [0] * world, f"worker exit codes {codes} (tracebacks above)"
    return torch.load(os.path.join(out_dir, "result.pt"))


@pytest.fixture
def engine(checkpoints):
    from safetensors.torch import load_file

    from slime.backends.embedded import EmbeddedEngine, EngineConfig, EngineHTTPServer

    eng = EmbeddedEngine(EngineConfig(model_path=checkpoints[1]))
    server = EngineHTTPServer(eng, "tok", 0)
    server.start_in_thread()
    try:
        yield eng, {"url": server.url, "token": "tok", "kind": "embedded"}, load_file(
            os.path.join(checkpoints[1], "model.safetensors"))
    finally:
        server.stop()
        eng.shutdown()


@pytest.fixture(scope="module")
def reference(checkpoints, tmp_path_factory):
    """What the single-rank sender exports: name -> tensor (each name once)."""
    from safetensors.torch import load_file
    from slime.backends.embedded import EmbeddedEngine, EngineConfig, EngineHTTPServer

    eng = EmbeddedEngine(EngineConfig(model_path=checkpoints[1]))
    server = EngineHTTPServer(eng, "tok", 0)
    server.start_in_thread()
    try:
        got = _spawn(1, checkpoints[0], {}, tmp_path_factory.mktemp("single"), {"url": server.url, "token": "tok"})
    finally:
        server.stop()
        eng.shutdown()
    names = [n for bucket in got["exported"] for n, _ in bucket]
    assert len(names) == len(set(names)), "the single-rank export repeats names"
    exported = {n: t for bucket in got["exported"] for n, t in bucket}
    trainer_ckpt = load_file(os.path.join(checkpoints[0], "model.safetensors"))
    assert exported.keys() <= trainer_ckpt.keys() and len(exported) > 20
    assert any(not torch.equal(trainer_ckpt[n], load_file(os.path.join(checkpoints[1], "model.safetensors"))[n])
               for n in exported)  # the sync has something to change
    assert got["ok"]["metrics"]["weight_sync/checked_tensors"] == len(exported)
    return exported


def _assert_failed_sync_published_nothing(outcome: dict, stage: int, ranks: list[dict], engine_sums: dict) -> None:
    assert "No space left on device" in outcome["error"], outcome["error"]
    assert "/update_weights_from_disk" not in outcome["posts"], outcome["posts"]
    assert "/continue_generation" in outcome["posts"]  # generation goes on with the old weights
    assert not outcome["left"], f"stage {stage}'s failure left a partial checkpoint on disk"
    # rank 0 (which speaks to the engines) and the failing sender raise; the other ranks need not know
    assert all("error" in r[f"failed_{stage}"] for r in ranks if r["stage"] == stage and r["sender"])
    held = outcome["engine"]["checksums"]
    assert held.keys() == engine_sums.keys() and all(held[n] == engine_sums[n] for n in held), \
        f"the engine's weights changed although stage {stage} failed to write"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [{"pp": 2}, {"tp": 2, "pp": 2}], ids=["pp2", "tp2_pp2"])
def test_disk_sync_under_pipeline_parallel_is_the_single_rank_export_and_all_or_nothing(
        checkpoints, engine, reference, layout, tmp_path):
    from safetensors.torch import load_file

    from slime.utils.weight_checksum import named_checksums

    eng, endpoint, loaded = engine
    engine_sums = named_checksums([(n, eng.name_map.resolve(n)) for n in eng.name_map.checkpoint_names()])
    assert all(torch.equal(eng.name_map.resolve(n), loaded[n]) for n in reference)
    world = 2 * layout.get("tp", 1)
    got = _spawn(world, checkpoints[0], layout, tmp_path, endpoint)
    assert sorted(r["stage"] for r in got["ranks"] if r["sender"]) == [0, 1]  # one sender per stage
    for stage in (1, 0):
        _assert_failed_sync_published_nothing(got[f"failed_{stage}"], stage, got["ranks"], engine_sums)

    ok = got["ok"]
    assert "error" not in ok, ok.get("error")
    assert ok["posts"].count("/update_weights_from_disk") == 1
    model_bytes = sum(t.numel() * t.element_size() for t in reference.values())
    assert ok["metrics"]["weight_sync/checked_tensors"] == len(reference)
    assert ok["metrics"]["weight_sync/bytes"] == model_bytes
    # the checkpoint the engine loaded (kept: --update-weight-disk-keep-files): every name once, in its stage's files
    written = tmp_path / "sync" / "weight_v000003"
    files = sorted(os.listdir(written))
    assert {f.split("-")[1] for f in files} == {"stage00", "stage01"}
    counts, stage_of, on_disk = Counter(), {}, {}
    for f in files:
        for name, t in load_file(str(written / f)).items():
            counts[name] += 1
            stage_of.setdefault(name, set()).add(f.split("-")[1])
            on_disk[name] = t
    assert [n for n, c in counts.items() if c > 1] == [], "names written twice"
    assert sorted(set(reference) - set(counts)) == [], "names no stage wrote"
    assert sorted(set(counts) - set(reference)) == [], "names the single-rank sender does not send"
    for name, t in reference.items():
        assert on_disk[name].dtype == t.dtype and torch.equal(on_disk[name], t), f"file: {name}"
        held = eng.name_map.resolve(name)
        assert held.dtype == t.dtype and torch.equal(held, t), f"engine: {name}"
    assert eng.weight_version == "3"
