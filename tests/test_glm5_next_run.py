"""A 3-rollout colocated run of train.py on a tiny GLM-5.3-Flash (the multimodal glm5_next checkpoint: KDA + DSA
layers, mHC streams, MoE, a vision tower) on CPU: the embedded engine serves it through transformers'
Glm5NextForConditionalGeneration, every rollout's weight sync is verified by checksum and carries the text model
alone (the frozen vision tower is not sent), and the engine's log-probs equal the trainer's on every rollout,
including those generated after a training step changed the weights (|dlp| <= 1e-5 per token, float32 on both
sides; measured <= 1e-6). --entropy-coef makes every step move the weights whatever the reward. The checkpoint has
its MTP layer (tests/glm5_next_helpers.add_mtp_layer) and the run trains it (--enable-mtp-training): the MTP loss is
reported (a random head over 512 tokens: about ln 512), and the sync to the embedded engine (no draft model)
leaves it out."""

from __future__ import annotations

import json
import os

import pytest
from logged_run import run_train

from slime.utils.metrics import read_metrics

pytestmark = pytest.mark.timeout(420)

DLP_BOUND = 1e-5


def test_three_rollouts_colocated_glm5_next(tmp_path):
    from slime.rollout.synthetic import make_dataset
    from slime_plugins.models.common.tiny import write_tiny_checkpoint
    from slime_plugins.models.registry import parse_hf_config

    from glm5_next_helpers import add_mtp_layer

    model = add_mtp_layer(write_tiny_checkpoint(str(tmp_path / "model"), "glm5_next"))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in make_dataset(16, seed=0, min_len=5, max_len=5)))
    out = str(tmp_path / "run")
    argv = ["--hf-checkpoint", model, "--prompt-data", str(data),
           "--apply-chat-template", "--rm-type", "synthetic", "--rollout-seed", "3", "--rollout-batch-size", "2",
           "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6", "--use-dynamic-batch-size",
           "--max-tokens-per-gpu", "256", "--lr", "5e-3", "--entropy-coef", "0.01", "--num-cpus", "2",
           "--colocate", "--num-rollout", "3", "--enable-mtp-training", "--mtp-loss-scaling-factor", "0.2",
           "--output-dir", out]
    run_train(argv, timeout=400)  # fails the test on a non-zero exit
    records = read_metrics(out)
    family, arch = parse_hf_config(json.load(open(os.path.join(model, "config.json"))))
    text_tensors = len(family.call("hf_names", arch))  # no vision tower, no MTP
    assert len(records) == 3
    for r in records:
        assert r["train_rollout_logprob_abs_diff_max"] <= DLP_BOUND, r["train_rollout_logprob_abs_diff_max"]
        assert r["weight_sync/checked_tensors"] == text_tensors  # checksums compared (a mismatch raises)
        assert r["train/grad_norm"] > 0  # each sync sends changed weights
        assert 4.0 < r["train/mtp_loss"] < 9.0, r["train/mtp_loss"]
