"""GLM-5.3-Flash served by the embedded engine, and written by common/tiny.py. The engine runs the multimodal
`glm5_next` checkpoint through transformers' Glm5NextForConditionalGeneration (vision tower loaded, never synced,
left unchanged) and a flat `glm5_next_text` one through slime_plugins/models/glm5_next/causal_lm.py. One batched wave of prompts of different lengths whose
rows finish at different steps (the KDA recurrent / conv states and the DSA indexer cache drop rows mid-wave):
its sampled log-probs equal the trainer's teacher-forced ones before and after a weight sync of what the trainer
sends (5e-5, as the conformance suite: KV-cached decode against a full pass; measured <= 1e-5), and the sync
lands on every engine tensor bit for bit under the checkpoint's names (hc_attn_fn, q_conv1d, per-expert ...)."""

from __future__ import annotations

import pytest
import torch
from glm5_next_helpers import hf_reference, save_checkpoints
from model_conformance import trainer_logprobs

from slime.backends.megatron import export_hf, load_hf_model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_checkpoints(hf_reference(), tmp_path_factory.mktemp("glm5_next_engine"))


def _wave(engine, prompts, step):
    reqs = [engine.make_request(p, {"max_new_tokens": 3 + 3 * i, "temperature": 1.0, "sampling_seed": i + 10 * step,
                                    "ignore_eos": True}, return_logprob=True) for i, p in enumerate(prompts)]
    engine.submit_batch(reqs)
    for r in reqs:
        assert r.done.wait(120)
    return reqs


@pytest.mark.parametrize("model_type,cls", [("glm5_next", "Glm5NextForConditionalGeneration"),
                                            ("glm5_next_text", "Glm5NextTextForCausalLM")])
def test_engine_logprobs_match_the_trainer_before_and_after_a_sync(checkpoints, model_type, cls):
    from slime.backends.embedded import EmbeddedEngine, EngineConfig
    from slime_plugins.models.common.weights import is_mtp_name

    model = load_hf_model(checkpoints[model_type])
    engine = EmbeddedEngine(EngineConfig(model_path=checkpoints[model_type]))
    assert type(engine.model).__name__ == cls
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (3, 13, 21, 6)]  # 21 > index_topk
    vision = {n: engine.name_map.resolve(n).clone() for n in engine.name_map.checkpoint_names() if ".visual." in n}
    assert bool(vision) == (model_type == "glm5_next")
    try:
        for step in range(2):
            reqs = _wave(engine, prompts, step)
            want = trainer_logprobs(model, prompts, [r.output_ids for r in reqs])
            for i, (r, lp) in enumerate(zip(reqs, want)):
                assert len(r.logprobs) == 3 + 3 * i
                torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float32), lp, rtol=0, atol=5e-5)
            if step == 0:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype) * p.std().clamp(min=1e-3))
                named = [(n, t.contiguous()) for b in export_hf(model) for n, t in b if not is_mtp_name(model.arch, n)]
                assert not [n for n, _ in named if ".visual." in n]  # the frozen vision tower is not synced
                assert sorted(n for n, _ in named) == sorted(set(engine.name_map.checkpoint_names()) - set(vision))
                assert engine.update_from_named_tensors(named, weight_version="1") == len(named)
                assert all(torch.equal(engine.name_map.resolve(n), t) for n, t in named)
        assert all(torch.equal(engine.name_map.resolve(n), t) for n, t in vision.items())
    finally:
        engine.shutdown()


def test_tiny_writer_flat_and_multimodal(tmp_path):
    """common/tiny.py writes both checkpoint kinds by transformers' save_pretrained under the on-disk names: the
    flat one holds the multimodal one's text tensors under `model.` (no vision tower), and its logits under
    Glm5NextTextForCausalLM equal the trainer's (1e-5 of max |logit|)."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from slime_plugins.models.common.tiny import write_tiny_checkpoint
    from slime_plugins.models.glm5_next.causal_lm import Glm5NextTextForCausalLM

    paths = {t: write_tiny_checkpoint(str(tmp_path / t), t, seed=3) for t in ("glm5_next", "glm5_next_text")}
    multimodal, flat = (set(load_file(f"{paths[t]}/model.safetensors")) for t in ("glm5_next", "glm5_next_text"))
    assert {n.replace("model.language_model.", "model.") for n in multimodal if ".visual." not in n} == flat
    assert {"model.layers.0.hc_attn_fn", "model.layers.0.self_attn.q_conv1d.weight"} <= flat
    assert json.load(open(f"{paths['glm5_next_text']}/config.json"))["model_type"] == "glm5_next_text"
    ids = torch.randint(3, 512, (2, 11), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(11).expand(2, -1)
    for t, cls in (("glm5_next_text", Glm5NextTextForCausalLM), ("glm5_next", AutoModelForImageTextToText)):
        ref = cls.from_pretrained(paths[t], dtype=torch.float32)
        with torch.no_grad():
            want, ours = ref(input_ids=ids, position_ids=pos).logits, load_hf_model(paths[t])(ids, pos)
        assert float((ours - want).abs().max() / want.abs().max()) <= 1e-5, t
