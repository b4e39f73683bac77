"""--update-weight-mode disk against a real embedded engine: the trainer writes a complete safetensors checkpoint
per sync under --update-weight-disk-dir, the engine loads it through /update_weights_from_disk (SGLang's
endpoint), the checksums are verified, and the directory is removed unless --update-weight-disk-keep-files."""

from __future__ import annotations

import os

import pytest
import torch

from slime.backends.megatron.weight_sync import EngineEndpoint, WeightSync, WeightSyncError, resolve_mode


@pytest.fixture
def engine(tmp_path):
    from glm5_helpers import write_checkpoint
    from safetensors.torch import load_file

    from slime.backends.embedded import EmbeddedEngine, EngineConfig, EngineHTTPServer

    ckpt = write_checkpoint(tmp_path / "glm", "glm_moe_dsa", seed=3)
    eng = EmbeddedEngine(EngineConfig(model_path=ckpt))
    server = EngineHTTPServer(eng, "tok", 0)
    server.start_in_thread()
    try:
        yield eng, EngineEndpoint(server.url, token="tok"), load_file(f"{ckpt}/model.safetensors")
    finally:
        server.stop()
        eng.shutdown()


def _trained(original: dict[str, torch.Tensor], step: float) -> dict[str, torch.Tensor]:
    """The trainer's weights after some steps: random moves, some held as transposed (non-contiguous) views."""
    g = torch.Generator().manual_seed(int(step * 10))
    out = {}
    for name, t in original.items():
        moved = t + step * torch.randn(t.shape, generator=g).to(t.dtype)
        out[name] = moved.t().contiguous().t() if moved.dim() == 2 and moved.shape[0] != moved.shape[1] else moved
    return out


def _export(weights: dict[str, torch.Tensor], bucket: int = 5):
    names = sorted(weights)
    return lambda: ([(n, weights[n]) for n in names[i:i + bucket]] for i in range(0, len(names), bucket))


def _recording(ws: WeightSync) -> list[str]:
    paths, post = [], ws.post
    ws.post = lambda e, path, *a, **k: (paths.append(path), post(e, path, *a, **k))[1]
    return paths


@pytest.mark.parametrize("keep_files", [False, True])
def test_each_sync_is_loaded_from_its_own_checkpoint_and_verified(engine, tmp_path, keep_files):
    eng, endpoint, original = engine
    root = str(tmp_path / "sync")
    for version, step in ((1, 0.5), (2, -0.25)):
        weights = _trained(original, step)
        assert any(not t.is_contiguous() for t in weights.values())
        ws = WeightSync("disk", _export(weights), [endpoint], rank=0, disk_dir=root, disk_keep_files=keep_files)
        paths = _recording(ws)
        metrics = ws.sync(version=version)
        assert metrics["weight_sync/checked_tensors"] == len(original)
        assert paths.count("/update_weights_from_disk") == 1
        assert paths[0] == "/pause_generation"  # loaded while paused, generation goes on after it
        assert paths.index("/update_weights_from_disk") < paths.index("/continue_generation")
        for name, t in weights.items():
            assert torch.equal(eng.name_map.resolve(name), t), name
        assert eng.weight_version == str(version)
        written = os.path.join(root, f"weight_v{version:06d}")
        assert os.path.isdir(written) == keep_files
        if keep_files:  # one file per bucket, every weight once
            from safetensors.torch import load_file

            files = sorted(os.listdir(written))
            assert len(files) == -(-len(original) // 5) and all(f.endswith(".safetensors") for f in files)
            loaded = {k: v for f in files for k, v in load_file(os.path.join(written, f)).items()}
            assert loaded.keys() == original.keys() and all(torch.equal(loaded[n], weights[n]) for n in loaded)
        ws.close()


def test_an_incomplete_checkpoint_is_refused_and_the_engine_resumes_unchanged(engine, tmp_path):
    eng, endpoint, original = engine
    before = {n: eng.name_map.resolve(n).clone() for n in original}
    weights = _trained(original, 0.5)
    del weights[sorted(weights)[0]]  # a stage that never wrote its part
    ws = WeightSync("disk", _export(weights), [endpoint], rank=0, disk_dir=str(tmp_path / "sync"))
    paths = _recording(ws)
    with pytest.raises(WeightSyncError, match="update_weights_from_disk.*lacks 1 weights"):
        ws.sync(version=1)
    assert "/continue_generation" in paths and "/flush_cache" in paths  # generation goes on with the old weights
    assert all(torch.equal(eng.name_map.resolve(n), t) for n, t in before.items())
    assert not os.path.exists(tmp_path / "sync" / "weight_v000001")


def test_disk_mode_without_a_directory_is_one_line(engine):
    _, endpoint, original = engine
    ws = WeightSync("disk", _export(original), [endpoint], rank=0)
    with pytest.raises(ValueError, match="--update-weight-disk-dir"):
        ws.sync(version=1)


def test_resolve_mode_keeps_disk():
    assert resolve_mode("disk", colocate=True, ipc_capable=True) == "disk"
    assert resolve_mode("disk", colocate=False, ipc_capable=False) == "disk"


def test_the_command_line_names_the_missing_directory(tmp_path, capsys):
    import json

    from slime.config.arguments import parse_args

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm4_moe", "num_hidden_layers": 2}))
    base = ["--hf-checkpoint", str(tmp_path), "--num-rollout", "2", "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "2", "--update-weight-mode", "disk"]
    with pytest.raises(SystemExit) as exit_:
        parse_args(base)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == ("train.py: error: --update-weight-mode disk needs --update-weight-disk-dir "
                                               "DIR (a directory the trainer and every engine see at the same path)")
    args = parse_args(base + ["--update-weight-disk-dir", str(tmp_path / "sync"), "--update-weight-disk-keep-files"])
    assert (args.update_weight_mode, args.update_weight_disk_dir, args.update_weight_disk_keep_files) == \
        ("disk", str(tmp_path / "sync"), True)
