"""Records tests/data/upstream_multiturn_masks.json: upstream slime's MultiTurnLossMaskGenerator (qwen3 and
qwen3_5) on a Qwen3-style template that drops earlier turns' reasoning and wraps consecutive tool messages in one
user turn, with this project's tiny word-level tokenizer:
    git -C UPSTREAM show COMMIT:slime/utils/mask_utils.py > /tmp/up_mask_utils.py
    python tests/data/record_upstream_multiturn_masks.py /tmp/up_mask_utils.py COMMIT OUT.json
tests/test_multiturn_masks.py checks slime.utils.mask_utils against every case.
"""
import json
import sys
import types

from slime.utils.tiny_tokenizer import build_tokenizer

TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<|im_start|>user\n{% endif -%}"
    "<tool_response> {{ m.content }} </tool_response>\n"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' -%}<|im_end|>\n{% endif -%}"
    "{%- elif m.role == 'assistant' -%}<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_user and m.reasoning_content is defined -%}"
    "<think>\n{{ m.reasoning_content }} </think>\n{% endif -%}{{ m.content }}<|im_end|>\n"
    "{% else -%}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{% endif -%}")
SPECIAL = ["<|im_start|>", "<|im_end|>", "system", "user", "assistant", "tool", "<think>", "</think>",
           "<tool_response>", "</tool_response>"]


def tokenizer():
    tok = build_tokenizer(64)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.chat_template = TEMPLATE
    return tok


def A(content, reasoning=None, **kw):
    return {"role": "assistant", "content": content, **({"reasoning_content": reasoning} if reasoning else {}), **kw}


CHATS = [
    [{"role": "user", "content": "a b"}, A("c", "d e")],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, A("b c", "d"),
     {"role": "user", "content": "e"}, A("f", "g h")],  # the first answer's reasoning is dropped once a user follows
    [{"role": "user", "content": "a"}, A("b", "c"), {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"},
     A("d e", "f")],  # parallel tool messages: one user turn
    [{"role": "user", "content": "a"}, A("b"), {"role": "tool", "content": "1 2"}, A("c", step_loss_mask=0),
     {"role": "user", "content": "d"}, A("e f", "g"), {"role": "tool", "content": "3"},
     {"role": "tool", "content": "4"}, {"role": "tool", "content": "5"}, A("h")],
]


if __name__ == "__main__":
    up = types.ModuleType("up")
    exec(compile(open(sys.argv[1]).read(), "up_mask_utils.py", "exec"), up.__dict__)
    cases = []
    for kind in ("qwen3", "qwen3_5"):
        gen = up.MultiTurnLossMaskGenerator(tokenizer(), kind)
        for chat in CHATS:
            ids, mask = gen.get_loss_mask(json.loads(json.dumps(chat)))
            cases.append({"tokenizer_type": kind, "messages": chat, "token_ids": ids, "loss_mask": mask,
                          "texts": gen.get_text_from_loss_mask(ids, mask)})
    json.dump({"repository": "THUDM/slime", "commit": sys.argv[2], "module": "slime/utils/mask_utils.py",
               "tokenizer": "tests/data/record_upstream_multiturn_masks.py tokenizer()", "cases": cases},
              open(sys.argv[3], "w"), indent=0)
    print(len(cases))
