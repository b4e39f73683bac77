"""slime.observability.rollout_data_utils against upstream's on the same inputs
(tests/data/upstream_rollout_data_utils_cases.json, recorded by tests/data/record_upstream_rollout_data_utils_cases.py
from upstream's file at the commit it names): dtypes and values of the training tensors, which routed-experts
captures and compact-rollout ids are refused (and for which sample / layers), and which samples a subsampled
debug rollout keeps; plus a save -> load round trip of real Samples through the project's file format."""

from __future__ import annotations

import json
import os
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from slime.observability import rollout_data_utils as rdu
from slime.utils.types import Sample

with open(os.path.join(os.path.dirname(__file__), "data", "upstream_rollout_data_utils_cases.json")) as f:
    RECORD = json.load(f)


def cases(fn):
    return [c for c in RECORD["cases"] if c["fn"] == fn]


def outcome(fn, *args):
    try:
        fn(*args)
        return None
    except (ValueError, AssertionError) as e:
        return [type(e).__name__, str(e)]


def same_outcome(ours, upstream):
    """Same exception type and the same numbers and lists in the message (sample index, layers, shapes, ids)."""
    if ours is None or upstream is None:
        return ours == upstream
    facts = re.compile(r"\[[^\]]*\]|\([^)]*\)|-?\d+")
    return ours[0] == upstream[0] and facts.findall(ours[1]) == facts.findall(upstream[1])


def _tensor_facts(t):
    return {"dtype": str(t.dtype), "shape": list(t.shape), "values": t.tolist(), "contiguous": t.is_contiguous()}


def test_tensorize_matches_upstream():
    (case,) = cases("tensorize_rollout_data_for_training")
    data = {k: list(v) if isinstance(v, list) else v for k, v in case["input"].items()}
    for key, dtypes in case["numpy_dtypes"].items():
        data[key] = [v if d is None else np.array(v, dtype=d) for v, d in zip(data[key], dtypes)]
    data["rollout_log_probs"][1].flags.writeable = False  # a read-only array is copied, not refused
    mm = data["multimodal_train_inputs"][1]
    mm["pixel_values"] = np.array(mm["pixel_values"], dtype=np.float32)
    rdu.tensorize_rollout_data_for_training(data)
    out = case["out"]
    for key in rdu.ROLLOUT_TENSOR_DTYPES:
        assert [_tensor_facts(t) for t in data[key]] == out[key], key
    assert _tensor_facts(data["rollout_mask_sums"]) == out["rollout_mask_sums"]
    assert data["response_lengths"] == out["response_lengths"]  # other fields untouched
    got_mm = data["multimodal_train_inputs"]
    assert got_mm[0] is None and got_mm[1]["n"] == out["multimodal_train_inputs"][1]["n"]
    assert _tensor_facts(got_mm[1]["pixel_values"]) == out["multimodal_train_inputs"][1]["pixel_values"]


@pytest.mark.parametrize("case", cases("validate_rollout_routed_experts_for_replay"),
                         ids=lambda c: f"{c['experts']}-{c['args'].get('moe_layer_freq')}")
def test_routed_experts_validation_matches_upstream(case):
    experts = []
    for spec in case["experts"]:
        t = torch.ones(spec["shape"], dtype=torch.int32)
        for layer in spec.get("zero_layers", []):
            t[:, layer, :] = 0
        experts.append(t)
    ours = outcome(rdu.validate_rollout_routed_experts_for_replay, experts, SimpleNamespace(**case["args"]))
    assert same_outcome(ours, case["out"]), (ours, case["out"])


def _build(node):
    return [_build(n) for n in node] if isinstance(node, list) else Sample(rollout_id=node["rid"])


@pytest.mark.parametrize("case", cases("validate_rollout_id_annotated"), ids=lambda c: json.dumps(c["tree"]))
def test_rollout_id_validation_matches_upstream(case):
    tree = case["tree"]
    ours = outcome(rdu.validate_rollout_id_annotated, _build(tree) if isinstance(tree, list) else Sample(rollout_id=5))
    assert same_outcome(ours, case["out"]), (ours, case["out"])


def test_non_list_node_is_refused():
    with pytest.raises(AssertionError, match="str"):
        rdu.validate_rollout_id_annotated([["x"]])


def test_subsampled_load_matches_upstream(tmp_path):
    template = str(tmp_path / "r_{rollout_id}.pt")
    written = set()
    for case in cases("load_debug_rollout_data"):
        if case["n"] not in written:  # one file per sample count, as upstream's recording saved it
            rdu.save_debug_rollout_data(template, [Sample(index=i, rollout_id=i) for i in range(case["n"])],
                                        rollout_id=3, evaluation=False)
            written = {case["n"]}
        got = rdu.load_debug_rollout_data(template, rollout_id=3, subsample_ratio=case["subsample_ratio"])
        assert [s.index for s in got] == case["out"], case


def test_save_and_load_round_trip(tmp_path):
    template = str(tmp_path / "d" / "{rollout_id}.pt")
    samples = [Sample(index=i, tokens=[1, 2, 3 + i], response_length=2, reward=0.5 * i, loss_mask=[1, 0],
                      rollout_log_probs=[-0.25, -1.5]) for i in range(3)]
    rdu.save_debug_rollout_data(template, samples, rollout_id=7, evaluation=False)
    back = rdu.load_debug_rollout_data(template, rollout_id=7)
    assert [(s.index, s.tokens, s.reward, s.loss_mask, s.rollout_log_probs) for s in back] == \
        [(s.index, s.tokens, s.reward, s.loss_mask, s.rollout_log_probs) for s in samples]
    rdu.save_debug_rollout_data(template, {"math": {"samples": samples[:2]}, "code": {"samples": samples[2:]}},
                                rollout_id=7, evaluation=True)
    saved = torch.load(template.format(rollout_id="eval_7"), weights_only=True)
    assert saved["rollout_id"] == 7 and [d["index"] for d in saved["samples"]] == [0, 1, 2]
    rdu.save_debug_rollout_data(None, samples, rollout_id=8, evaluation=False)  # no template: nothing written
    assert sorted(os.listdir(tmp_path / "d")) == ["7.pt", "eval_7.pt"]
