"""Upstream slime's multi-turn loss masks for `--loss-mask-type qwen3` and `qwen3_5`
(slime.utils.mask_utils.MultiTurnLossMaskGenerator dispatches here).

qwen3: each turn rendered on its own (after a probe user turn, whose tokens are cut off again), consecutive tool
messages together as Qwen's templates wrap them in one user turn; an assistant turn trains everything after the
generation prompt's tokens. Templates that rewrite earlier turns (Qwen3 drops past reasoning) do not matter:
every turn is rendered as if it were the last, so earlier answers keep their `<think>` block.
qwen3_5: the whole conversation rendered once; each assistant turn's characters from after
`<|im_start|>assistant\\n` (and an opening `<think>\\n`) through `<|im_end|>` and its newline are trained, and
a token is trained when any of its characters is (needs a fast tokenizer's offsets). The tokens are the
template's own rendering, so rewritten earlier turns appear as the template writes them.
"""

from __future__ import annotations

from typing import Any

PROBE_TURN = {"role": "user", "content": "FOR CALCULATING LOSS MASK ONLY"}
ASSISTANT_HEADER, THINK_OPEN, TURN_END = "<|im_start|>assistant\n", "<think>\n", "<|im_end|>"


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
        trained = first["role"] == "assistant" and first.get("step_loss_mask", 1) == 1
        header = generator.gen_token_length if trained else len(ids)
        mask += [0] * min(header, len(ids)) + [1] * max(len(ids) - header, 0)
        tokens += ids
    return tokens, mask


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
