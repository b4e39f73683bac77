"""slime.backends.megatron_utils.cp_utils (upstream's path) equals upstream's functions at every recorded
context-parallel rank and size (tests/data/upstream_cp_utils_cases.json, recorded from upstream's file at the
commit it names). Offsets and slices exactly; the reducer within 1e-6 (float32 sums)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from slime.backends.megatron_utils import cp_utils

with open(os.path.join(os.path.dirname(__file__), "data", "upstream_cp_utils_cases.json")) as f:
    RECORD = json.load(f)


def _lists(x):
    return [_lists(v) for v in x] if isinstance(x, (list, tuple)) else x


@pytest.mark.parametrize("case", RECORD["cases"], ids=lambda c: f"{c['fn']}-r{c['cp_rank']}of{c['cp_size']}")
def test_equals_upstream(case, monkeypatch):
    monkeypatch.setattr(cp_utils, "_cp_rank_size", lambda: (case["cp_rank"], case["cp_size"]))
    fn = case["fn"]
    if fn == "get_logits_and_tokens_offset_with_cp":
        assert _lists(cp_utils.get_logits_and_tokens_offset_with_cp(case["total"], case["response"])) == case["out"]
    elif fn == "slice_log_prob_with_cp":
        lp = torch.tensor(case["log_prob"])
        assert cp_utils.slice_log_prob_with_cp(lp, case["total"], case["response"]).tolist() == case["out"]
        assert cp_utils.slice_log_prob_with_cp(case["log_prob"], case["total"], case["response"]) == case["out_list"]
    elif fn == "slice_with_cp":
        assert cp_utils.slice_with_cp(torch.tensor(case["tokens"]), case["pad"]).tolist() == case["out"]
    else:
        reducer = cp_utils.get_sum_of_sample_mean(case["totals"], case["responses"],
                                                  [torch.tensor(m) for m in case["masks"]],
                                                  calculate_per_token_loss=case["per_token"])
        assert float(reducer(torch.tensor(case["x"]))) == pytest.approx(case["out"], rel=1e-6, abs=1e-6)


def test_size_one_without_megatron_groups():
    lp = torch.randn(4)
    assert cp_utils.all_gather_with_cp(lp, 9, 4) is lp and cp_utils.slice_with_cp(lp, 0) is lp
    with pytest.raises(ValueError, match="length mismatch"):
        cp_utils.slice_log_prob_with_cp(lp, 9, 5)
    with pytest.raises(ValueError, match="context-parallel size > 1"):
        cp_utils.get_logits_and_tokens_offset_with_cp(9, 4)
