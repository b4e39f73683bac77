"""--deterministic-mode with --sglang-enable-deterministic-inference (upstream's run-qwen2.5-0.5B-reproducibility.sh
pair): two runs of the same command give the same numbers bit for bit.

- the embedded engine with deterministic inference computes each request alone: the same request gives the same
  tokens and log-probs whether it runs by itself or among concurrent ones (bitwise);
- two train() runs (colocated, tiny GLM-5 MoE checkpoint, GRPO on the seeded random reward, 2 rollouts): every metric that is not a time
  equal (==), and the trained weights (--save-hf) equal bit for bit;
- the accelerator's set_deterministic (what the trainer calls at start) turns on torch's deterministic algorithms."""

from __future__ import annotations

import math
import os
import threading

import pytest
import torch

from slime.utils.metrics import read_metrics

pytestmark = pytest.mark.timeout(300)


def _is_timing(key: str) -> bool:
    return any(w in key for w in ("time", "seconds", "per_s", "_s/", "perf/", "tokens_per", "throughput", "wall",
                                  "memory", "mem/", "timestamp", "_at"))


def test_set_deterministic_turns_on_deterministic_algorithms(monkeypatch):
    from slime.accelerator import AscendAccelerator, CudaAccelerator, get_accelerator

    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda mode, warn_only=False: seen.append((mode, warn_only)))
    seen: list = []
    get_accelerator().set_deterministic()
    assert seen == [(True, False)]
    # the collectives' switches each device documents (set before the process group exists)
    assert CudaAccelerator.deterministic_env(None)["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert AscendAccelerator.deterministic_env(None) == {"HCCL_DETERMINISTIC": "true"}


def test_deterministic_engine_is_batch_invariant(tmp_path):
    from glm5_helpers import random_batch

    from slime.backends.embedded import EmbeddedEngine, EngineConfig
    from slime_plugins.models.common.tiny import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(str(tmp_path / "qwen2"), "qwen2", seed=2, initializer_range=0.2)
    engine = EmbeddedEngine(EngineConfig(model_path=ckpt, deterministic=True, batch_wait_s=0.05))
    params = {"max_new_tokens": 5, "temperature": 1.0, "ignore_eos": True}
    prompts = [random_batch(1, n, 512, 40 + n)[0][0].tolist() for n in (2, 5, 9, 3)]
    try:
        alone = engine.generate(prompts[1], params | {"sampling_seed": 7}, return_logprob=True)
        results: dict[int, object] = {}

        def run(i: int) -> None:
            results[i] = engine.generate(prompts[i], params | {"sampling_seed": 7 if i == 1 else i},
                                         return_logprob=True)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        together = results[1]
        assert together.output_ids == alone.output_ids
        assert together.logprobs == alone.logprobs  # bitwise: no batch shape reaches the request's numbers
        assert engine.stats["waves"] + engine.stats["joins"] >= len(prompts) + 1  # one row at a time
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def ray_session():
    import ray

    from slime.ray.placement_group import init_ray

    os.environ.setdefault("SLIME_CPU_THREADS", "1")
    init_ray(num_cpus=2)
    yield
    ray.shutdown()


def _run(inputs, out: str) -> list[dict]:
    from slime.config.arguments import parse_args
    from slime.train import train

    argv = ["--hf-checkpoint", inputs["model"], "--prompt-data", inputs["data"], "--apply-chat-template",
            "--rm-type", "random", "--rollout-shuffle", "--rollout-seed", "5", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "4", "--rollout-max-response-len", "4", "--rollout-temperature", "1",
            "--use-dynamic-batch-size", "--max-tokens-per-gpu", "128", "--lr", "5e-3", "--num-cpus", "2",
            "--colocate", "--num-rollout", "2", "--deterministic-mode", "--sglang-enable-deterministic-inference",
            "--save", os.path.join(out, "ckpt"), "--save-interval", "2", "--save-hf", os.path.join(out, "hf"),
            "--output-dir", out]
    return train(parse_args(argv))


def test_two_deterministic_runs_are_identical(tmp_path, ray_session):
    from glm5_helpers import write_run_inputs
    from safetensors.torch import load_file

    inputs = write_run_inputs(tmp_path, 16, (4, 6))
    first = _run(inputs, str(tmp_path / "a"))
    second = _run(inputs, str(tmp_path / "b"))
    assert len(first) == len(second) == 2
    assert read_metrics(str(tmp_path / "a")) == first
    compared = 0
    for a, b in zip(first, second):
        assert a.keys() == b.keys()
        for key in a:
            if _is_timing(key) or not isinstance(a[key], (int, float)):
                continue
            assert a[key] == b[key] or (math.isnan(a[key]) and math.isnan(b[key])), (key, a[key], b[key])
            compared += 1
    assert compared >= 20 and first[1]["train/grad_norm"] > 0
    hf = [os.path.join(tmp_path, run, "hf") for run in ("a", "b")]
    files = sorted(f for f in os.listdir(hf[0]) if f.endswith(".safetensors"))
    assert files and files == sorted(f for f in os.listdir(hf[1]) if f.endswith(".safetensors"))
    for f in files:
        wa, wb = load_file(os.path.join(hf[0], f)), load_file(os.path.join(hf[1], f))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)
