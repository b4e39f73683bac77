"""Every `--loss-mask-type` upstream's MultiTurnLossMaskGenerator has (qwen, qwen3, qwen3_5, distill_qwen, and qwen
on a DeepSeek-distill tokenizer, which upstream routes to distill_qwen) equals upstream's masks on the real chat
templates of the models each type is for (tests/data/upstream_mask_types.jsonl, recorded from upstream's module at
the commit it names by tests/data/record_upstream_mask_types.py): exact token ids, loss masks and
get_text_from_loss_mask texts on chats whose earlier turns the template rewrites (Qwen3/Qwen3.5 drop past
reasoning), with parallel tool messages, and on random chats (odd turn counts, tool calls, empty contents, system
prompts, step_loss_mask 0, a tools list)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from slime.utils.mask_utils import LOSS_MASK_TYPES, MultiTurnLossMaskGenerator

DATA = os.path.join(os.path.dirname(__file__), "data")
_spec = importlib.util.spec_from_file_location("record_upstream_mask_types",
                                               os.path.join(DATA, "record_upstream_mask_types.py"))
_recorder = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_recorder)  # the recorded chats' tokenizer and templates
with open(os.path.join(DATA, "upstream_mask_types.jsonl")) as f:
    HEADER, *CASES = [json.loads(line) for line in f]
CHATS = HEADER["chats"]
_GENERATORS: dict[tuple[str, str], MultiTurnLossMaskGenerator] = {}


def generator(kind: str, template: str) -> MultiTurnLossMaskGenerator:
    if (kind, template) not in _GENERATORS:
        _GENERATORS[kind, template] = MultiTurnLossMaskGenerator(_recorder.tokenizer(template), kind)
    return _GENERATORS[kind, template]


def test_record_covers_every_type_and_chat():
    assert HEADER["repository"] == "THUDM/slime" and len(HEADER["commit"]) == 40
    assert {kind for kind, _ in HEADER["combos"]} == set(LOSS_MASK_TYPES)
    assert [tuple(c) for c in HEADER["combos"]] == _recorder.COMBOS and CHATS == _recorder.chats()
    assert len(CASES) == len(HEADER["combos"]) * len(CHATS)
    roles = [[m["role"] for m in chat["messages"]] for chat in CHATS]
    assert any("tool" in r and r[r.index("tool") + 1] == "tool" for r in roles)  # parallel tool messages
    assert any(len(r) % 2 == 1 for r in roles) and any(r[0] == "system" for r in roles)
    assert any(m.get("step_loss_mask") == 0 for chat in CHATS for m in chat["messages"])
    assert any(m["content"] == "" for chat in CHATS for m in chat["messages"])


@pytest.mark.parametrize("combo", [tuple(c) for c in HEADER["combos"]], ids="-".join)
def test_equals_upstream(combo):
    gen = generator(*combo)
    for case in (c for c in CASES if (c["tokenizer_type"], c["template"]) == combo):
        chat = CHATS[case["chat"]]
        ids, mask = gen.get_loss_mask(json.loads(json.dumps(chat["messages"])), tools=chat["tools"])
        want_mask = [int(m) for m in case["loss_mask"]]
        assert (ids, mask) == (case["token_ids"], want_mask), (combo, case["chat"])
        assert gen.get_text_from_loss_mask(ids, mask) == case["texts"], (combo, case["chat"])


def test_rewritten_history_gives_each_type_its_own_mask():
    """The chat whose first answer's reasoning Qwen3's template drops once a user follows: qwen renders each
    message alone (no <think>), qwen3 as the last turn (its <think> kept), qwen3_5 as the template writes the
    whole chat (the first answer without it)."""
    chat = CHATS[1]["messages"]
    texts = {kind: generator(kind, "qwen3").get_text_from_loss_mask(*generator(kind, "qwen3").get_loss_mask(chat))
             for kind in ("qwen", "qwen3", "qwen3_5")}
    assert texts["qwen"] == ["4<|im_end|>\n", "6<|im_end|>\n"]
    assert texts["qwen3"] == ["<think>\nadd them\n</think>\n\n4<|im_end|>\n",
                              "<think>\nadd again\n</think>\n\n6<|im_end|>\n"]
    assert texts["qwen3_5"] == ["4<|im_end|>\n", "add again\n</think>\n\n6<|im_end|>\n"]
    whole = _recorder.tokenizer("qwen3").apply_chat_template(chat, tokenize=True, return_dict=False)
    assert generator("qwen3_5", "qwen3").get_loss_mask(chat)[0] == list(whole)


def test_upstream_method_names_and_distill_routing():
    gen = generator("qwen", "deepseek_r1_distill_qwen")
    chat = CHATS[1]["messages"]
    assert gen.get_loss_mask(chat) == gen.gen_multi_turn_loss_mask_distill_qwen(chat)
    assert gen.get_loss_mask(chat) != gen.gen_multi_turn_loss_mask_qwen(chat)
    qwen3 = generator("qwen3", "qwen3")
    assert qwen3.get_system_message_length() == (qwen3.system_message_length, qwen3.gen_token_length)
    assert qwen3.find_all_sublist_indices([1, 2, 1, 2, 1], [1, 2, 1]) == [0, 2]


def test_a_turn_shorter_than_the_generation_prompt_is_refused():
    """qwen3 on Qwen2.5's template (which writes a default system prompt before the probe turn) cuts turns short;
    upstream then returns a mask longer than the tokens, here one line says the template does not fit."""
    gen = MultiTurnLossMaskGenerator(_recorder.tokenizer("qwen2_5"), "qwen3")
    with pytest.raises(ValueError, match="fewer than the generation prompt's .* does not fit --loss-mask-type qwen3"):
        gen.get_loss_mask(CHATS[0]["messages"])
