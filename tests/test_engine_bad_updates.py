"""The embedded engine answers every bad /update_weights_from_disk with a 4xx naming the problem (the file,
the tensor), and nothing changes: weights and weight_version stay as they were."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch

from slime.backends.embedded import EmbeddedEngine, EngineConfig, EngineHTTPServer
from slime.utils.http_client import EngineClient, EngineError

TOKEN = "bad-updates-token"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from slime_plugins.models.glm5.tiny import write_tiny_checkpoint

    base = tmp_path_factory.mktemp("bad")
    good = write_tiny_checkpoint(str(base / "good"), "glm4_moe_lite", seed=0)
    other = write_tiny_checkpoint(str(base / "other"), "glm_moe_dsa", seed=1)
    engine = EmbeddedEngine(EngineConfig(model_path=good))
    server = EngineHTTPServer(engine, TOKEN, 0)
    server.start_in_thread()
    yield {"base": base, "good": good, "other": other, "server": server, "client": EngineClient(server.url, TOKEN)}
    server.stop()


def _copy(setup, name: str) -> tuple[str, str]:
    d = str(setup["base"] / name)
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(setup["good"], d)
    shard = next(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors"))
    return d, shard


def _truncated(setup):
    d, shard = _copy(setup, "truncated")
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size - 4096)
    return d, ["truncated", os.path.basename(shard)]


def _not_safetensors(setup):
    d, shard = _copy(setup, "garbage")
    with open(shard, "wb") as f:
        f.write(os.urandom(64))
    return d, ["header length", os.path.basename(shard)]


def _bad_header(setup):
    d, shard = _copy(setup, "header")
    with open(shard, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.read(n)
        data = f.read()
    header = b"{not json" + b" " * (n - 9)
    with open(shard, "wb") as f:
        f.write(struct.pack("<Q", n) + header + data)
    return d, ["unreadable header", os.path.basename(shard)]


def _missing_weight(setup):
    from safetensors.torch import load_file, save_file

    d, shard = _copy(setup, "missing")
    tensors = load_file(shard)
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, shard, metadata={"format": "pt"})
    return d, ["lacks 1 weights", dropped]


def _other_model(setup):
    return setup["other"], ["weight update rejected"]


def _not_a_dir(setup):
    return str(setup["base"] / "nowhere"), ["is not a directory"]


def _no_shards(setup):
    d, shard = _copy(setup, "noshards")
    os.remove(shard)
    os.remove(os.path.join(d, "model.safetensors.index.json")) if os.path.exists(
        os.path.join(d, "model.safetensors.index.json")) else None
    return d, ["no *.safetensors"]


@pytest.mark.parametrize("make", [_truncated, _not_safetensors, _bad_header, _missing_weight, _other_model,
                                  _not_a_dir, _no_shards])
def test_bad_disk_update_is_a_4xx_and_changes_nothing(setup, make):
    engine, client = setup["server"].engine, setup["client"]
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    version = engine.weight_version
    path, needles = make(setup)
    with pytest.raises(EngineError) as e:
        client.update_weights_from_disk(path, weight_version="bad")
    assert 400 <= e.value.status < 500, (e.value.status, e.value.message)
    assert "\n" not in e.value.message and "internal error" not in e.value.message
    for needle in needles:
        assert needle in e.value.message, e.value.message
    assert engine.weight_version == version
    for n, p in engine.model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_good_disk_update_still_loads(setup):
    client = setup["client"]
    out = client.update_weights_from_disk(setup["good"], weight_version="again")
    assert setup["server"].engine.weight_version == "again" and json.dumps(out)
