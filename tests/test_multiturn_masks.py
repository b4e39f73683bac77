"""--loss-mask-type qwen3 / qwen3_5 masks equal upstream's (tests/data/upstream_multiturn_masks.json, recorded
from upstream's MultiTurnLossMaskGenerator at the commit it names) on a Qwen3-style template that drops earlier
turns' reasoning and wraps parallel tool messages in one user turn; exact token ids, masks and trained texts."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from slime.utils.mask_utils import MultiTurnLossMaskGenerator

_spec = importlib.util.spec_from_file_location(
    "record_upstream_multiturn_masks", os.path.join(os.path.dirname(__file__), "data", "record_upstream_multiturn_masks.py"))
_recorder = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_recorder)
CHATS, tokenizer = _recorder.CHATS, _recorder.tokenizer  # the recorded chats and their tokenizer and template
with open(os.path.join(os.path.dirname(__file__), "data", "upstream_multiturn_masks.json")) as f:
    RECORD = json.load(f)


def test_record_covers_both_types_and_every_chat():
    assert RECORD["repository"] == "THUDM/slime" and len(RECORD["commit"]) == 40
    assert [c["tokenizer_type"] for c in RECORD["cases"]] == ["qwen3"] * len(CHATS) + ["qwen3_5"] * len(CHATS)


@pytest.mark.parametrize("case", RECORD["cases"], ids=lambda c: c["tokenizer_type"])
def test_equals_upstream(case):
    gen = MultiTurnLossMaskGenerator(tokenizer(), case["tokenizer_type"])
    ids, mask = gen.get_loss_mask(case["messages"])
    assert ids == case["token_ids"] and mask == case["loss_mask"]
    assert gen.get_text_from_loss_mask(ids, mask) == case["texts"]


def test_types_differ_where_the_template_rewrites_history():
    chat = RECORD["cases"][1]["messages"]
    qwen3 = MultiTurnLossMaskGenerator(tokenizer(), "qwen3").get_loss_mask(chat)
    qwen3_5 = MultiTurnLossMaskGenerator(tokenizer(), "qwen3_5").get_loss_mask(chat)
    assert len(qwen3[0]) > len(qwen3_5[0])  # qwen3 keeps the first answer's <think> block, the template drops it
