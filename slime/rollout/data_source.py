"""Prompts from a JSONL file: tokenized once, served in (optionally shuffled) epochs, resumable.

Each line is a JSON object; `--input-key` holds the prompt (a string, or a list of chat messages
{"role", "content"}), `--label-key` the reference answer for the reward. With
`--apply-chat-template` a string prompt becomes one user message and the tokenizer's chat
template (with the generation prompt) is applied. Shuffling is a permutation seeded by
`--rollout-seed` + epoch, so a resumed run sees exactly the prompts it would have seen.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any


class DataSourceError(ValueError):
    """Bad prompt data or data-source state. One line: the problem and the fix."""


@dataclass
class PromptItem:
    group_index: int
    prompt: Any
    prompt_ids: list[int]
    label: Any
    metadata: dict[str, Any]


def tokenize_prompt(tokenizer: Any, prompt: Any, apply_chat_template: bool) -> list[int]:
    if apply_chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    elif isinstance(prompt, str):
        text = prompt
    else:
        raise DataSourceError("prompt is a list of chat messages: pass --apply-chat-template")
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class JsonlDataSource:
    def __init__(self, path: str, tokenizer: Any, input_key: str = "prompt", label_key: str | None = "label",
                 metadata_key: str | None = "metadata", apply_chat_template: bool = False, shuffle: bool = False,
                 seed: int = 42, max_prompt_len: int | None = None) -> None:
        self.path, self.shuffle, self.seed = path, shuffle, seed
        self.items: list[tuple[Any, list[int], Any, dict]] = []
        dropped = 0
        try:
            f = open(path, encoding="utf-8")
        except OSError as e:
            raise DataSourceError(f"--prompt-data {path!r} cannot be read ({e.strerror}); pass a JSONL file") from e
        with f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataSourceError(f"{path}:{lineno} is not valid JSON ({e.msg}); one JSON object per line") from e
                if not isinstance(rec, dict) or input_key not in rec:
                    raise DataSourceError(f"{path}:{lineno} has no key {input_key!r}; set --input-key to the prompt's key")
                prompt = rec[input_key]
                ids = tokenize_prompt(tokenizer, prompt, apply_chat_template)
                if not ids:
                    raise DataSourceError(f"{path}:{lineno}: the prompt tokenizes to nothing")
                if max_prompt_len is not None and len(ids) > max_prompt_len:
                    dropped += 1
                    continue
                meta = rec.get(metadata_key) if metadata_key else None
                self.items.append((prompt, ids, rec.get(label_key) if label_key else None,
                                   meta if isinstance(meta, dict) else {}))
        if not self.items:
            raise DataSourceError(f"{path} holds no usable prompts ({dropped} longer than --rollout-max-prompt-len)")
        self.dropped = dropped
        self.epoch = 0
        self.offset = 0  # position inside the current epoch's order
        self.next_group_index = 0
        self.next_sample_index = 0
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        return len(self.items)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, n: int) -> list[PromptItem]:
        """The next `n` prompts, crossing into the next epoch (reshuffled) when this one runs out."""
        if n <= 0:
            raise DataSourceError(f"--rollout-batch-size must be >= 1, got {n}")
        out = []
        for _ in range(n):
            if self.offset >= len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._epoch_order(self.epoch)
            prompt, ids, label, meta = self.items[self._order[self.offset]]
            self.offset += 1
            out.append(PromptItem(self.next_group_index, prompt, list(ids), label, dict(meta)))
            self.next_group_index += 1
        return out

    def take_sample_indices(self, n: int) -> range:
        start = self.next_sample_index
        self.next_sample_index += n
        return range(start, start + n)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "shuffle": self.shuffle,
                "num_prompts": len(self.items), "next_group_index": self.next_group_index,
                "next_sample_index": self.next_sample_index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_prompts") != len(self.items):
            raise DataSourceError(f"data-source state is for {state.get('num_prompts')} prompts but {self.path} has "
                                  f"{len(self.items)}; resume with the same --prompt-data and --rollout-max-prompt-len")
        if state.get("seed") != self.seed or state.get("shuffle") != self.shuffle:
            raise DataSourceError("data-source state was saved with another --rollout-seed/--rollout-shuffle; "
                                  "resume with the same flags")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self.next_group_index, self.next_sample_index = int(state["next_group_index"]), int(state["next_sample_index"])
        self._order = self._epoch_order(self.epoch)
