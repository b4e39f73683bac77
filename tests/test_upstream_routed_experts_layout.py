"""cp_utils.prepare_routed_experts_for_routing_replay (upstream's path) equals upstream's at every recorded tensor- and
context-parallel rank and size, padding multiplier, sequence parallelism and CP layout (exactly; 120 cases in
tests/data/upstream_routed_experts_cases.json, recorded by tests/data/record_upstream_routed_experts_cases.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from slime.backends.megatron_utils import cp_utils

with open(os.path.join(os.path.dirname(__file__), "data", "upstream_routed_experts_cases.json")) as f:
    RECORD = json.load(f)
EXPERTS = [torch.tensor(e, dtype=torch.int32) for e in RECORD["experts"]]
TOKENS = [torch.arange(n) for n in RECORD["lengths"]]


def _id(c):
    return (f"tp{c['tp'][0]}of{c['tp'][1]}-cp{c['cp'][0]}of{c['cp'][1]}-m{c['multiplier']}"
            f"{'-sp' if c['sequence_parallel'] else ''}{'-allgather' if c['allgather_cp'] else ''}")


def test_record_names_the_upstream_commit():
    assert RECORD["repository"] == "THUDM/slime" and len(RECORD["commit"]) == 40 and len(RECORD["cases"]) == 120


@pytest.mark.parametrize("case", RECORD["cases"], ids=_id)
def test_equals_upstream(case, monkeypatch):
    monkeypatch.setattr(cp_utils, "_tp_rank_size", lambda: tuple(case["tp"]))
    monkeypatch.setattr(cp_utils, "_cp_rank_size", lambda: tuple(case["cp"]))
    out = cp_utils.prepare_routed_experts_for_routing_replay(
        EXPERTS, TOKENS, num_experts=RECORD["num_experts"], data_pad_size_multiplier=case["multiplier"],
        sequence_parallel=case["sequence_parallel"], allgather_cp=case["allgather_cp"])
    assert out.dtype == torch.int32 and out.tolist() == case["out"]


def test_mismatched_inputs_fail_in_one_line():
    with pytest.raises(ValueError, match="3 routed-experts tensors for 2 samples"):
        cp_utils.prepare_routed_experts_for_routing_replay(EXPERTS, TOKENS[:2], num_experts=5,
                                                           data_pad_size_multiplier=1, sequence_parallel=False,
                                                           allgather_cp=False)
    with pytest.raises(ValueError, match="but the last"):
        cp_utils.prepare_routed_experts_for_routing_replay(EXPERTS, [t[:-1] for t in TOKENS], num_experts=5,
                                                           data_pad_size_multiplier=1, sequence_parallel=False,
                                                           allgather_cp=False)
