"""Upstream slime's multi-turn loss masks, one function per `--loss-mask-type`
(slime.utils.mask_utils.MultiTurnLossMaskGenerator dispatches here). None of them needs the template to render
a prefix of the conversation as a prefix of the whole, so templates that rewrite earlier turns (Qwen3 drops past
reasoning) and parallel tool messages are masked as upstream masks them, never refused.

qwen: each message rendered on its own (the tools with the first only); a later message, unless a system one,
loses the template's default system prompt (the generator's `system_message_length` tokens); an assistant message
trains everything after the generation prompt's tokens (`gen_token_length`). A tokenizer with DeepSeek's
`<｜Assistant｜>` token gets the distill_qwen mask instead (upstream's rule).
qwen3: like qwen, but each turn rendered after a probe user turn (whose tokens are cut off again) and consecutive
tool messages rendered together, as Qwen's templates wrap them in one user turn; the first turn is rendered
before the probe turn, with the tools. Every turn is rendered as if it were the last, so earlier answers keep
their `<think>` block.
qwen3_5: the whole conversation rendered once; each assistant turn's characters from after
`<|im_start|>assistant\\n` (and an opening `<think>\\n`) through `<|im_end|>` and its newline are trained, and
a token is trained when any of its characters is (needs a fast tokenizer's offsets). The tokens are the
template's own rendering, so rewritten earlier turns appear as the template writes them.
distill_qwen: the first message rendered with the generation prompt, then the last message's content tokenized
alone and trained; the messages between are left out (upstream's single-answer distillation layout).
"""

from __future__ import annotations

from typing import Any

PROBE_TURN = {"role": "user", "content": "FOR CALCULATING LOSS MASK ONLY"}
ASSISTANT_HEADER, THINK_OPEN, TURN_END = "<|im_start|>assistant\n", "<think>\n", "<|im_end|>"
DISTILL_ASSISTANT_TOKEN = "<｜Assistant｜>"


def _trains(message: dict) -> bool:
    return message["role"] == "assistant" and message.get("step_loss_mask", 1) == 1


def _turn_mask(generator: Any, message: dict, length: int) -> list[int]:
    """An assistant turn trains its tokens after the generation prompt's; any other turn trains nothing."""
    if not _trains(message):
        return [0] * length
    header = generator.gen_token_length
    if length < header:  # upstream would return a mask longer than the tokens here
        raise ValueError(f"an assistant turn renders as {length} tokens, fewer than the generation prompt's "
                         f"{header}: this chat template does not fit --loss-mask-type {generator.tokenizer_type}")
    return [0] * header + [1] * (length - header)


def per_message_mask(generator: Any, messages: list[dict], tools: list | None) -> tuple[list[int], list[int]]:
    tokens: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        ids = generator._render([message], tools if i == 0 else None, generation_prompt=False)
        if i > 0 and message["role"] != "system":
            ids = ids[generator.system_message_length:]
        tokens += ids
        mask += _turn_mask(generator, message, len(ids))
    return tokens, mask


def _turn_groups(messages: list[dict]):
    """(index of the group's first message, the group): consecutive tool messages together."""
    i = 0
    while i < len(messages):
        end = i + 1
        if messages[i]["role"] == "tool":
            while end < len(messages) and messages[end]["role"] == "tool":
                end += 1
        yield i, messages[i:end]
        i = end


def per_turn_mask(generator: Any, messages: list[dict], tools: list | None) -> tuple[list[int], list[int]]:
    render = generator._render
    probe = render([PROBE_TURN], None, generation_prompt=False)
    tokens: list[int] = []
    mask: list[int] = []
    for i, group in _turn_groups(messages):
        first = group[0]
        if i == 0:
            ids = render(group + [PROBE_TURN], tools, generation_prompt=False)[:-len(probe)]
        else:
            ids = render([PROBE_TURN] + group, None, generation_prompt=False)[len(probe):]
        if first["role"] != "system" and i > 0:
            ids = ids[generator.system_message_length:]
        tokens += ids
        mask += _turn_mask(generator, first, len(ids))
    return tokens, mask


def prompt_and_last_answer_mask(tokenizer: Any, messages: list[dict],
                                tools: list | None) -> tuple[list[int], list[int]]:
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True, tools=tools)
    prompt_ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    answer_ids = list(tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"])
    trained = int(messages[-1].get("step_loss_mask", 1) == 1)
    return prompt_ids + answer_ids, [0] * len(prompt_ids) + [trained] * len(answer_ids)


def _trained_characters(text: str, messages: list[dict]) -> list[int]:
    marks = [0] * (len(text) + 1)  # +1/-1 at span edges, summed below
    cursor = 0
    for message in messages:
        if message["role"] != "assistant":
            continue
        header = text.find(ASSISTANT_HEADER, cursor)
        if header < 0:
            raise ValueError("Failed to locate assistant message in rendered Qwen3.5 chat template output.")
        start = header + len(ASSISTANT_HEADER)
        end = text.find(TURN_END, start)
        if end < 0:
            raise ValueError("Failed to locate <|im_end|> for assistant message in rendered text.")
        end += len(TURN_END) + (text[end + len(TURN_END):end + len(TURN_END) + 1] == "\n")
        cursor = end
        if message.get("step_loss_mask", 1) != 1:
            continue
        if text.startswith(THINK_OPEN, start):
            start += len(THINK_OPEN)
        marks[start] += 1
        marks[end] -= 1
    out, running = [], 0
    for m in marks[:-1]:
        running += m
        out.append(1 if running > 0 else 0)
    return out


def rendered_text_mask(tokenizer: Any, messages: list[dict], tools: list | None) -> tuple[list[int], list[int]]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, tools=tools, return_dict=False)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoded.get("offset_mapping")
    if offsets is None:
        raise ValueError("Qwen3.5 loss mask generation requires a fast tokenizer with `return_offsets_mapping` "
                         "support.")
    ids = list(encoded["input_ids"])
    rendered = tokenizer.apply_chat_template(messages, tokenize=True, tools=tools, return_dict=False)
    if ids != list(rendered["input_ids"] if isinstance(rendered, dict) else rendered):
        raise ValueError("Qwen3.5 rendered text tokenization does not match `apply_chat_template(..., "
                         "tokenize=True)` output.")
    trained = _trained_characters(text, messages)
    prefix = [0]
    for t in trained:
        prefix.append(prefix[-1] + t)
    return ids, [1 if end > start and prefix[end] > prefix[start] else 0 for start, end in offsets]
