"""Records tests/data/upstream_mask_types.json: upstream slime's MultiTurnLossMaskGenerator for every
`--loss-mask-type` it has (qwen, qwen3, qwen3_5, distill_qwen, and qwen on a tokenizer with DeepSeek's
`<｜Assistant｜>`, which upstream routes to distill_qwen) on the real chat templates of the models those types are
for, stored in tests/data/chat_templates/ as published with the models' tokenizers (Qwen2.5-Instruct, Qwen3,
Qwen3.5, DeepSeek-R1-Distill-Qwen), and a small byte-level BPE tokenizer (tests/data/mask_types_tokenizer.json)
with those models' added tokens, so that no hub access is needed:
    git -C UPSTREAM show COMMIT:slime/utils/mask_utils.py > /tmp/up_mask_utils.py
    python tests/data/record_upstream_mask_types.py /tmp/up_mask_utils.py COMMIT OUT.json
(`--train-tokenizer` first rebuilds the BPE tokenizer from chats rendered with the four templates.)
The chats: hand-made ones whose earlier assistant turns the template rewrites (Qwen3/Qwen3.5 drop past reasoning)
and with parallel tool messages, then random ones (odd turn counts, tool calls, empty contents, system prompts,
reasoning, step_loss_mask 0, a tools list). tests/test_mask_types.py checks slime.utils.mask_utils against
every case.
"""
from __future__ import annotations

import copy
import json
import os
import random
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER_FILE = os.path.join(HERE, "mask_types_tokenizer.json")
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
DEEPSEEK_SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                    "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                    "<｜tool▁output▁end｜>"]
# Qwen2's pre-tokenizer split (letters with one leading non-letter, single digits, newline runs)
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
# (tokenizer_type, template): each type on the templates it is used with
COMBOS = [("qwen", "qwen2_5"), ("qwen", "qwen3"), ("qwen3", "qwen3"), ("qwen3", "qwen3_5"),
          ("qwen3_5", "qwen3_5"), ("qwen3_5", "qwen3"), ("distill_qwen", "deepseek_r1_distill_qwen"),
          ("qwen", "deepseek_r1_distill_qwen")]


def template(name: str) -> str:
    with open(os.path.join(HERE, "chat_templates", name + ".jinja")) as f:
        text = f.read()
    return text[:-1] if text.endswith("\n") else text  # the published templates end without a newline


def tokenizer(template_name: str):
    """The stored BPE tokenizer with the template's model family's added tokens and the template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(TOKENIZER_FILE))
    if template_name.startswith("deepseek"):
        tok.add_special_tokens({"bos_token": DEEPSEEK_SPECIAL[0], "eos_token": DEEPSEEK_SPECIAL[1],
                                "additional_special_tokens": DEEPSEEK_SPECIAL[2:]})
        tok.add_tokens(["<think>", "</think>"])
    else:
        tok.add_special_tokens({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                "additional_special_tokens": QWEN_SPECIAL})
        tok.add_tokens(QWEN_ADDED)
    tok.chat_template = template(template_name)
    return tok


TOOLS = [{"type": "function", "function": {"name": "terminal", "description": "Run a shell command.",
                                           "parameters": {"type": "object", "properties": {
                                               "command": {"type": "string", "description": "the command"}},
                                               "required": ["command"]}}}]
WORDS = ["alpha", "beta", "gamma", "7", "42", "x+y", "中文", "é", "ok.", "def", "{", "}", "ls", "-la", "\n", "\n\n",
         "  ", "is", "the", "Answer:", "(3)", "README.md"]


def _text(rng: random.Random, low: int = 0, high: int = 6) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def _call(rng: random.Random, index: int) -> dict:
    return {"id": f"call_{index}", "type": "function",
            "function": {"name": "terminal", "arguments": {"command": _text(rng, 1, 3)}}}


def _assistant(rng: random.Random, with_calls: int) -> dict:
    message = {"role": "assistant", "content": _text(rng)}
    style = rng.random()
    if style < 0.3:
        message["reasoning_content"] = _text(rng, 1, 5)
    elif style < 0.5:
        message["content"] = f"<think>\n{_text(rng, 1, 4)}\n</think>\n\n{_text(rng, 0, 4)}"
    if with_calls:
        message["tool_calls"] = [_call(rng, i) for i in range(with_calls)]
    if rng.random() < 0.15:
        message["step_loss_mask"] = 0
    return message


def random_chat(rng: random.Random) -> dict:
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": _text(rng, 0, 4)})
    messages.append({"role": "user", "content": _text(rng, 0, 5)})
    for _ in range(rng.randint(1, 3)):
        calls = rng.choice([0, 0, 1, 2])
        messages.append(_assistant(rng, calls))
        for _ in range(calls):  # parallel tool results, one message each
            messages.append({"role": "tool", "name": "terminal", "content": _text(rng, 0, 4)})
        if calls:
            messages.append(_assistant(rng, 0))
        if rng.random() < 0.5:
            messages.append({"role": "user", "content": _text(rng, 0, 4)})
    if rng.random() < 0.3 and messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": _text(rng, 1, 3)})  # ends with a prompt: odd turn counts
    return {"messages": messages, "tools": TOOLS if rng.random() < 0.3 else None}


def A(content, reasoning=None, **kw):
    return {"role": "assistant", "content": content, **({"reasoning_content": reasoning} if reasoning else {}), **kw}


HAND_MADE = [
    {"messages": [{"role": "system", "content": "SYSTEM"}, {"role": "user", "content": "USER_1"}, A("ANSWER_1"),
                  {"role": "user", "content": "USER_2"}, A("<think>REASONING_2</think>\nANSWER_2")], "tools": None},
    {"messages": [{"role": "user", "content": "what is 2+2"}, A("4", "add them"), {"role": "user", "content": "and 3+3"},
                  A("6", "add again")], "tools": None},  # the first answer's reasoning is dropped once a user follows
    {"messages": [{"role": "system", "content": "SYSTEM"}, {"role": "user", "content": "list both"},
                  {"role": "assistant", "content": "CALL", "tool_calls": [_call(random.Random(1), 0),
                                                                          _call(random.Random(2), 1)]},
                  {"role": "tool", "name": "terminal", "content": "a.py"},
                  {"role": "tool", "name": "terminal", "content": "b.py"}, A("two files", "saw them")],
     "tools": TOOLS},  # parallel tool messages: one user turn
    {"messages": [{"role": "user", "content": "q"}, A("", "think only"), {"role": "user", "content": ""}, A("")],
     "tools": None},  # empty contents
]


def chats(count: int = 14, seed: int = 38) -> list[dict]:
    rng = random.Random(seed)
    return HAND_MADE + [random_chat(rng) for _ in range(count)]


def train_tokenizer() -> None:
    """A 700-token byte-level BPE over chats rendered with the four templates (added tokens left out)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = []
    for name in ("qwen2_5", "qwen3", "qwen3_5", "deepseek_r1_distill_qwen"):
        tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
        tok.chat_template = template(name)
        for chat in chats(60, seed=1):
            deepseek = name.startswith("deepseek")  # its tool calls take string arguments: its prompts only
            text = tok.apply_chat_template(chat["messages"][:1] if deepseek else chat["messages"],
                                           tools=chat["tools"], tokenize=False, add_generation_prompt=deepseek)
            for special in QWEN_SPECIAL + QWEN_ADDED + DEEPSEEK_SPECIAL:
                text = text.replace(special, " ")
            corpus.append(text)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_SPLIT), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=700, initial_alphabet=
                                                        pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    bpe.save(TOKENIZER_FILE)


def record(upstream_module_path: str, commit: str, out_path: str) -> int:
    up = types.ModuleType("up")
    with open(upstream_module_path) as f:
        exec(compile(f.read(), "up_mask_utils.py", "exec"), up.__dict__)
    all_chats, cases = chats(), []
    for kind, template_name in COMBOS:
        gen = up.MultiTurnLossMaskGenerator(tokenizer(template_name), kind)
        for index, chat in enumerate(all_chats):
            ids, mask = gen.get_loss_mask(copy.deepcopy(chat["messages"]), tools=copy.deepcopy(chat["tools"]))
            assert len(ids) == len(mask)
            cases.append({"tokenizer_type": kind, "template": template_name, "chat": index, "token_ids": ids,
                          "loss_mask": "".join(map(str, mask)), "texts": gen.get_text_from_loss_mask(ids, mask)})
    lines = [json.dumps({"repository": "THUDM/slime", "commit": commit, "module": "slime/utils/mask_utils.py",
                         "tokenizer": "tests/data/record_upstream_mask_types.py tokenizer(template)",
                         "combos": COMBOS, "chats": all_chats}, ensure_ascii=False)]
    lines += [json.dumps(case, ensure_ascii=False) for case in cases]
    with open(out_path, "w") as f:  # one JSON object per line: the header, then one case per line
        f.write("\n".join(lines) + "\n")
    return len(cases)


if __name__ == "__main__":
    if sys.argv[1] == "--train-tokenizer":
        train_tokenizer()
        sys.argv.pop(1)
    print(record(*sys.argv[1:4]))
