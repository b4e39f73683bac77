"""Which tokens of a chat an SFT step trains (upstream slime's `MultiTurnLossMaskGenerator` contract,
`--loss-mask-type`): the tokens each assistant turn adds to the rendered conversation after the chat
template's generation prompt (for Qwen: the content, then `<|im_end|>\\n`); system, user and tool turns and
the `<|im_start|>assistant\\n` header are not trained. A message with `"step_loss_mask": 0` is not trained.

The mask comes from rendering prefixes of the conversation: turn i's tokens are
render(messages[:i+1]) minus render(messages[:i]) (with the generation prompt for an assistant turn), which
holds for any template whose rendering of a prefix is a prefix of the whole (types qwen and distill_qwen).
Templates that rewrite earlier turns (Qwen3's thinking template drops past `<think>` blocks) break that; such a
conversation is refused in one line naming the turn rather than trained with a shifted mask. Types qwen3 and
qwen3_5 compute upstream's masks instead (slime.utils.multiturn_masks), which need no such property.
"""

from __future__ import annotations

from typing import Any

from slime.utils import multiturn_masks

LOSS_MASK_TYPES = ("qwen", "qwen3", "qwen3_5", "distill_qwen")


def get_response_lengths(loss_masks: list[list[int]]) -> list[int]:
    """Per mask: the tokens from its first trained one to the end (the sample's response), 0 if none."""
    return [len(mask) - mask.index(1) if 1 in mask else 0 for mask in loss_masks]


class MultiTurnLossMaskGenerator:
    def __init__(self, tokenizer: Any, tokenizer_type: str = "qwen") -> None:
        if tokenizer_type not in LOSS_MASK_TYPES:
            raise ValueError(f"--loss-mask-type {tokenizer_type!r}: choose one of {', '.join(LOSS_MASK_TYPES)}")
        self.tokenizer, self.tokenizer_type = tokenizer, tokenizer_type
        self.system_message_length = self.gen_token_length = 0
        if tokenizer_type == "qwen3":
            self.system_message_length, self.gen_token_length = self._probe_turn_lengths()

    def _probe_turn_lengths(self) -> tuple[int, int]:
        """(tokens before the first turn's header: a default system prompt; tokens of the generation prompt),
        measured from two rendered user turns holding a probe text (upstream's calibration)."""
        probe = "FOR TESTING ONLY"
        two_turns = [{"role": "user", "content": probe}] * 2
        raw = self.tokenizer(probe, add_special_tokens=False)["input_ids"]
        text = self.tokenizer.apply_chat_template(two_turns, add_special_tokens=False, tokenize=False)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        starts = [i for i in range(len(ids) - len(raw) + 1) if ids[i:i + len(raw)] == raw]
        if len(starts) != 2:
            raise ValueError(f"--loss-mask-type qwen3: the probe text appears {len(starts)} times in two rendered "
                             "turns (expected 2); this tokenizer's chat template is not Qwen-like")
        footer = len(ids) - len(raw) - starts[1]
        header = (starts[1] - starts[0]) - len(raw) - footer
        with_prompt = self._render(two_turns, None, generation_prompt=True)
        return starts[0] - header, len(with_prompt) - len(ids)

    def _render(self, messages: list[dict], tools: list | None, generation_prompt: bool) -> list[int]:
        if not messages:
            return []
        out = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False,
                                                 add_generation_prompt=generation_prompt)
        return list(out["input_ids"] if isinstance(out, dict) else out)

    def get_loss_mask(self, messages: list[dict], tools: list | None = None) -> tuple[list[int], list[int]]:
        """(token ids of the whole conversation, 1 for each trained token)."""
        if not messages:
            raise ValueError("an SFT sample needs at least one message")
        if self.tokenizer_type == "qwen3":
            return multiturn_masks.per_turn_mask(self, messages, tools)
        if self.tokenizer_type == "qwen3_5":
            return multiturn_masks.rendered_text_mask(self.tokenizer, messages, tools)
        tokens: list[int] = []
        mask: list[int] = []
        for i, message in enumerate(messages):
            assistant = message.get("role") == "assistant"
            before = self._render(messages[:i], tools, generation_prompt=assistant)
            after = self._render(messages[:i + 1], tools, generation_prompt=False)
            if after[:len(tokens)] != tokens or before[:len(tokens)] != tokens or after[:len(before)] != before:
                raise ValueError(f"message {i} ({message.get('role')}): the chat template renders the conversation "
                                 "so far differently once this turn is added, so its tokens cannot be masked; "
                                 "use a template whose prefixes render as prefixes")
            trained = assistant and message.get("step_loss_mask", 1) == 1
            mask += [0] * (len(before) - len(tokens)) + [int(trained)] * (len(after) - len(before))
            tokens = after
        return tokens, mask

    def get_response_lengths(self, loss_masks: list[list[int]]) -> list[int]:
        return get_response_lengths(loss_masks)

    def get_text_from_loss_mask(self, token_ids: list[int], loss_masks: list[int]) -> list[str]:
        """The decoded text of each run of consecutive trained tokens, in order (upstream's check of a mask)."""
        texts, run = [], []
        for token, trained in zip(token_ids, loss_masks):
            if trained == 1:
                run.append(token)
            elif run:
                texts.append(self.tokenizer.decode(run))
                run = []
        if run:
            texts.append(self.tokenizer.decode(run))
        return texts

    def get_loss_mask_with_multimodal_alignment(self, messages: list[dict], input_ids: list[int],
                                                tools: list | None = None) -> tuple[list[int], list[int]]:
        """The processor's input_ids with the text-only conversation's mask aligned to their end (a message's
        list content becomes its text parts joined by spaces; the processor's extra media tokens come first)."""
        def text_of(content):
            return " ".join(part.get("text", "") if isinstance(part, dict) else part for part in content
                            if isinstance(part, str) or (isinstance(part, dict) and part.get("type") == "text"))

        text_only = [{"role": m["role"], "content": text_of(m["content"])} if isinstance(m.get("content"), list)
                     else m for m in messages]
        _, mask = self.get_loss_mask(text_only, tools=tools)
        if len(input_ids) < len(mask):
            raise ValueError(f"input_ids (length={len(input_ids)}) is shorter than text loss_mask "
                             f"(length={len(mask)}); check that the processor and tokenizer tokenize alike")
        return input_ids, [0] * (len(input_ids) - len(mask)) + mask
