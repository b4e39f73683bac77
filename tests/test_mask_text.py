"""MultiTurnLossMaskGenerator.get_text_from_loss_mask and get_loss_mask_with_multimodal_alignment (upstream's
methods) on the ChatML tiny tokenizer of tests/data/upstream_sft_loss_masks.json: the trained runs' text is the
assistant turns' content with their end marker, and media tokens in front of the text keep the text's mask."""

from __future__ import annotations

import json
import os

import pytest

from slime.utils.mask_utils import MultiTurnLossMaskGenerator
from slime.utils.tiny_tokenizer import build_tokenizer

REF = json.load(open(os.path.join(os.path.dirname(__file__), "data", "upstream_sft_loss_masks.json")))


@pytest.fixture(scope="module")
def generator():
    tok = build_tokenizer(64)
    tok.add_special_tokens({"additional_special_tokens": REF["additional_special_tokens"]})
    tok.chat_template = REF["chat_template"]
    return MultiTurnLossMaskGenerator(tok, "qwen")


def test_text_of_each_trained_run(generator):
    tok = generator.tokenizer
    assert generator.get_text_from_loss_mask([5, 6, 7, 8, 9], [0, 1, 1, 0, 1]) == [tok.decode([6, 7]), tok.decode([9])]
    assert generator.get_text_from_loss_mask([5, 6], [1, 1]) == [tok.decode([5, 6])]
    assert generator.get_text_from_loss_mask([5, 6], [0, 0]) == []
    for case in REF["cases"]:  # upstream's masks: one run per trained assistant turn
        texts = generator.get_text_from_loss_mask(case["token_ids"], case["loss_mask"])
        trained = [m for m in case["messages"] if m["role"] == "assistant" and m.get("step_loss_mask", 1) == 1]
        assert len(texts) == len(trained) and all(m["content"] in t for m, t in zip(trained, texts))


def test_multimodal_alignment_pads_the_front(generator):
    messages = [{"role": "user", "content": [{"type": "image", "image": "x.png"}, {"type": "text", "text": "a b"}]},
                {"role": "assistant", "content": "b a"}]
    text_ids, text_mask = generator.get_loss_mask([{"role": "user", "content": "a b"}, messages[1]])
    input_ids = [1, 2, 3] + text_ids
    ids, mask = generator.get_loss_mask_with_multimodal_alignment(messages, input_ids)
    assert ids == input_ids and mask == [0, 0, 0] + text_mask
    with pytest.raises(ValueError, match="shorter than text loss_mask"):
        generator.get_loss_mask_with_multimodal_alignment(messages, text_ids[:-1])
