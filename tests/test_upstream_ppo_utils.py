"""slime.utils.ppo_utils under upstream's names equals upstream's functions on recorded cases
(tests/data/upstream_ppo_utils_cases.json, recorded by tests/data/record_upstream_ppo_utils_cases.py from
THUDM/slime at the commit the file names), and the CISPO loss's gradient is the one its definition gives.

Tolerances: float32 inputs; outputs agree within 2e-5 relative + 2e-5 absolute (upstream's chunked scans
sum in a different order than the sequential recurrence here; log-probs over a softmax likewise)."""

from __future__ import annotations

import json
import os
from argparse import Namespace

import pytest
import torch

from slime.utils import ppo_utils

DATA = os.path.join(os.path.dirname(__file__), "data", "upstream_ppo_utils_cases.json")
with open(DATA) as f:
    RECORD = json.load(f)
RTOL = ATOL = 2e-5


def _decode(x):
    if isinstance(x, dict) and "t" in x:
        return torch.tensor(x["t"], dtype=getattr(torch, x["dtype"]))
    if isinstance(x, dict) and "tuple" in x:
        return tuple(_decode(v) for v in x["tuple"])
    if isinstance(x, dict) and "namespace" in x:
        return Namespace(**x["namespace"])
    if isinstance(x, list):
        return [_decode(v) for v in x]
    return x


def _assert_same(ours, theirs, where):
    if theirs is None:
        assert ours is None, where
    elif isinstance(theirs, (tuple, list)):
        assert isinstance(ours, (tuple, list)) and len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _assert_same(a, b, f"{where}[{i}]")
    else:
        ours = torch.as_tensor(ours)
        assert tuple(ours.shape) == tuple(theirs.shape), f"{where}: shape {tuple(ours.shape)} vs {tuple(theirs.shape)}"
        torch.testing.assert_close(ours.double(), theirs.double(), rtol=RTOL, atol=ATOL, msg=where)


def test_record_names_the_upstream_commit():
    assert RECORD["upstream"] == "THUDM/slime" and len(RECORD["commit"]) == 40
    assert {c["fn"] for c in RECORD["cases"]} == {
        "compute_approx_kl", "compute_policy_loss", "compute_cispo_loss", "vanilla_gae", "chunked_gae",
        "chunked_discounted_returns", "get_reinforce_plus_plus_returns", "get_reinforce_plus_plus_baseline_advantages",
        "get_grpo_returns", "compute_gspo_kl", "compute_opsm_mask", "get_advantages_and_returns_batch",
        "calculate_log_probs_and_entropy"}


@pytest.mark.parametrize("case", RECORD["cases"], ids=lambda c: f"{c['fn']}:{c['note']}")
def test_equals_upstream(case):
    fn = getattr(ppo_utils, case["fn"])
    out = fn(*[_decode(a) for a in case["args"]], **{k: _decode(v) for k, v in case["kwargs"].items()})
    _assert_same(out, _decode(case["out"]), case["fn"])


def test_cispo_gradient_flows_through_clipped_tokens():
    """d loss / d log_prob = -clip(ratio) * A, also where the ratio is clipped (PPO's clip gives 0 there)."""
    torch.manual_seed(0)
    log_probs = (-torch.rand(9, dtype=torch.float64) * 2).requires_grad_()
    old = log_probs.detach() + torch.randn(9, dtype=torch.float64)
    adv = torch.randn(9, dtype=torch.float64)
    loss, clipfrac = ppo_utils.compute_cispo_loss(old - log_probs, log_probs, adv, 0.2, 0.28)
    loss.sum().backward()
    ratio = torch.exp(log_probs.detach() - old)
    clipped = ratio.clamp(0.8, 1.28)
    torch.testing.assert_close(log_probs.grad.float(), (-clipped * adv).float(), rtol=1e-6, atol=1e-6)
    assert clipfrac.sum() > 0 and bool((log_probs.grad[clipfrac.bool()] != 0).all())


def test_dual_clip_needs_c_above_one():
    with pytest.raises(ValueError, match="greater than 1.0"):
        ppo_utils.compute_policy_loss(torch.zeros(3), torch.ones(3), 0.2, 0.2, eps_clip_c=1.0)


def test_fully_masked_sequence_refused_like_upstream():
    with pytest.raises(ValueError, match="index 0 is fully masked"):
        ppo_utils.get_reinforce_plus_plus_returns(torch.ones(1), [torch.zeros(3)], [torch.zeros(3)], [3], [5], 0.1, 1.0)


def test_keep_mask_log_probs_match_a_float64_renormalisation():
    torch.manual_seed(1)
    logits, tokens = torch.randn(5, 13, dtype=torch.float64), torch.randint(0, 13, (5,))
    keep = torch.rand(5, 13) > 0.6
    lp, ent = ppo_utils.calculate_log_probs_and_entropy(logits.float(), tokens, None, with_entropy=True,
                                                        log_prob_keep_mask=keep)
    keep[torch.arange(5), tokens] = True
    ref = torch.log_softmax(logits.masked_fill(~keep, float("-inf")), -1)[torch.arange(5), tokens]
    full = torch.log_softmax(logits, -1)
    torch.testing.assert_close(lp.squeeze(-1).double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), -(full.exp() * full).sum(-1), rtol=1e-5, atol=1e-5)
