"""The embedded engine's gather wait: a batched request (its caller's whole batch, submit_batch) starts its
wave at once even below --max-running-requests; single requests still wait for more arrivals."""

from __future__ import annotations

import pytest

from slime.backends.embedded import EmbeddedEngine, EngineConfig

GREEDY = {"max_new_tokens": 4, "temperature": 0}
PROMPTS = [[5, 9, 14], [7, 3], [11, 12, 13, 2, 8]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from slime_plugins.models.glm5.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "lite"), "glm4_moe_lite", seed=0)


def test_whole_batch_starts_without_the_gather_wait(ckpt):
    # a gather wait far beyond the test's time: only a batch that is known complete can start a wave
    engine = EmbeddedEngine(EngineConfig(model_path=ckpt, batch_wait_s=600.0, max_batch_wait_s=600.0))
    try:
        single = engine.submit(engine.make_request(PROMPTS[0], GREEDY, True))
        assert not single.done.wait(1.0)  # a lone request waits for others to join its wave
        batch = engine.submit_batch([engine.make_request(p, GREEDY, True) for p in PROMPTS])
        assert all(r.done.wait(120) for r in [single, *batch])
        assert engine.stats["waves"] == 1  # the waiting request joined the batch's wave
        # batching changes no result: the single request and its copy in the batch agree
        assert single.output_ids == batch[0].output_ids and len(single.output_ids) == 4
    finally:
        engine.shutdown()


def test_batch_of_zero_token_requests_finishes_without_a_wave(ckpt):
    engine = EmbeddedEngine(EngineConfig(model_path=ckpt))
    try:
        reqs = engine.submit_batch([engine.make_request(p, {"max_new_tokens": 0}, True) for p in PROMPTS[:2]])
        assert all(r.done.wait(10) for r in reqs) and all(r.output_ids == [] for r in reqs)
        assert engine.stats["waves"] == 0
    finally:
        engine.shutdown()
