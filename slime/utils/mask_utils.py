"""Which tokens of a chat an SFT step trains: upstream slime's `MultiTurnLossMaskGenerator` (`--loss-mask-type`
qwen, qwen3, qwen3_5, distill_qwen), with upstream's masks for each type (slime.utils.multiturn_masks says how
each one renders the chat). Roughly: an assistant turn trains what it adds after the generation prompt (for Qwen:
its content, then `<|im_end|>\\n`); system, user and tool turns and the `<|im_start|>assistant\\n` header are not
trained; a message with `"step_loss_mask": 0` is not trained. Templates that rewrite earlier turns and parallel
tool messages are masked as upstream masks them. Upstream's per-type methods (`gen_multi_turn_loss_mask_qwen`,
...) and its calibration (`get_system_message_length`) are here under their names for code that calls them.
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
        if tokenizer_type in ("qwen", "qwen3"):  # upstream calibrates both, also for a distill tokenizer
            self.system_message_length, self.gen_token_length = self._probe_turn_lengths()

    def _probe_turn_lengths(self) -> tuple[int, int]:
        """(tokens before the first turn's header: a default system prompt; tokens of the generation prompt),
        measured from two rendered user turns holding a probe text (upstream's calibration)."""
        probe = "FOR TESTING ONLY"
        two_turns = [{"role": "user", "content": probe}] * 2
        raw = self.tokenizer(probe, add_special_tokens=False)["input_ids"]
        text = self.tokenizer.apply_chat_template(two_turns, add_special_tokens=False, tokenize=False)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        starts = self.find_all_sublist_indices(ids, raw)
        if len(starts) != 2:
            raise ValueError(f"--loss-mask-type {self.tokenizer_type}: the probe text appears {len(starts)} times in "
                             "two rendered turns (expected 2); this tokenizer's chat template is not Qwen-like")
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
        if self.tokenizer_type == "qwen":
            if multiturn_masks.DISTILL_ASSISTANT_TOKEN in self.tokenizer.get_added_vocab():
                return self.gen_multi_turn_loss_mask_distill_qwen(messages, tools)
            return self.gen_multi_turn_loss_mask_qwen(messages, tools)
        by_type = {"qwen3": self.gen_multi_turn_loss_mask_qwen3, "qwen3_5": self.gen_multi_turn_loss_mask_qwen3_5,
                   "distill_qwen": self.gen_multi_turn_loss_mask_distill_qwen}
        return by_type[self.tokenizer_type](messages, tools)

    # upstream's per-type methods and calibration, under upstream's names
    def gen_multi_turn_loss_mask_qwen(self, messages: list[dict], tools: list | None = None):
        return multiturn_masks.per_message_mask(self, messages, tools)

    def gen_multi_turn_loss_mask_qwen3(self, messages: list[dict], tools: list | None = None):
        return multiturn_masks.per_turn_mask(self, messages, tools)

    def gen_multi_turn_loss_mask_qwen3_5(self, messages: list[dict], tools: list | None = None):
        return multiturn_masks.rendered_text_mask(self.tokenizer, messages, tools)

    def gen_multi_turn_loss_mask_distill_qwen(self, messages: list[dict], tools: list | None = None):
        return multiturn_masks.prompt_and_last_answer_mask(self.tokenizer, messages, tools)

    def get_system_message_length(self) -> tuple[int, int]:
        return self._probe_turn_lengths()

    @staticmethod
    def find_all_sublist_indices(main_list: list, sublist: list) -> list[int]:
        return [i for i in range(len(main_list) - len(sublist) + 1) if main_list[i:i + len(sublist)] == sublist]

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
