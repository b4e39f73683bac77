"""Text requests that continue a text this engine returned keep the tokens it returned with it.

A multi-turn generate function written against SGLang's text `/generate` (upstream's search-r1 and retool
examples) sends `prompt + response so far` as text each turn and builds the trained sequence from the token ids
of `meta_info.output_token_logprobs` plus each tool observation tokenized on its own. Tokenizing the whole text
afresh does not give those ids back: a BPE merges across the turn boundaries (a model turn ending in "\\n"
followed by an observation starting "\\n\\n" becomes one "\\n\\n\\n" token), and a word-level tokenizer
re-splits text its decode joined. The engine then conditions later turns on other tokens than the trainer
trains on, and their trainer/engine log-probs disagree (SmolLM2-135M: 2e-3..1e-2 per rollout, 1e-5 otherwise).

So the engine remembers, for each text request, `input text + returned text -> input ids + output ids`, and
tokenizes a later text that begins with such a text as those ids followed by the rest tokenized on its own
(without special tokens): exactly the sequence such a plugin assembles. The returned text stands for the
returned ids even where a stop string was trimmed from it or special tokens were skipped in it: the plugin keeps
those ids. Memory is bounded (the oldest entries go first); a conversation whose turns reach another engine
(several engines behind the router) is tokenized afresh there.

A text that continues none of them (a conversation's first turn) is a prompt, tokenized as slime's rollout and
upstream's generate functions tokenize the prompt they train on: tokenizer(text, add_special_tokens=False), the
chat template carrying the model's special tokens. SGLang's text /generate adds the tokenizer's special tokens
instead, so a tokenizer that adds a BOS by default, with a template that starts with one (Llama 3's), feeds the
model two BOS that the trained sequence does not have."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any


class TextContinuations:
    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._ids_by_text: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, text: str, ids: list[int]) -> None:
        if not text:
            return
        with self._lock:
            self._ids_by_text[text] = list(ids)
            self._ids_by_text.move_to_end(text)
            while len(self._ids_by_text) > self.capacity:
                self._ids_by_text.popitem(last=False)

    def longest_prefix(self, text: str) -> tuple[str, list[int]] | None:
        """The longest remembered text that `text` begins with, and its ids."""
        with self._lock:
            best = max((k for k in self._ids_by_text if text.startswith(k)), key=len, default=None)
            return None if best is None else (best, list(self._ids_by_text[best]))

    def tokenize(self, text: str, tokenizer: Any) -> list[int]:
        """`text`'s ids: a remembered continuation's ids + the rest tokenized alone, else the whole text
        tokenized as the trainer's prompt is (no special tokens added: see the module's docstring)."""
        found = self.longest_prefix(text)
        if found is None:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        prefix, ids = found
        rest = text[len(prefix):]
        return ids + (list(tokenizer(rest, add_special_tokens=False)["input_ids"]) if rest else [])
