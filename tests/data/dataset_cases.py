"""Uses of upstream's slime.utils.data.Dataset (text prompts), run on upstream's module by
record_upstream_dataset_cases.py and on this project's by tests/test_upstream_dataset.py: each gives the samples'
prompts, labels and metadata, the length after filtering, and the order after shuffles."""

from __future__ import annotations

import json
import os

ROWS = [
    {"text": "add two and three", "label": "5", "metadata": {"src": "a"}, "tools": '[{"name": "calc"}]'},
    {"text": "a much longer prompt that goes on and on for many words", "label": "x"},
    {"text": "short", "label": "y", "metadata": None, "tools": [{"name": "search"}, {"name": "calc"}]},
    {"text": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}], "label": "z"},
    {"text": "four words right here", "label": "w", "metadata": {"k": 1}},
]


class WordTokenizer:
    """Ids are word positions in a growing vocabulary; the chat template joins role:content lines."""

    def __init__(self):
        self.vocab = {}

    def _ids(self, text):
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [self._ids(t) for t in texts] if isinstance(texts, list) else self._ids(texts)}

    def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=False, **kwargs):
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        if tools:
            lines.insert(0, "tools: " + ",".join(t["name"] for t in tools))
        if kwargs:
            lines.insert(0, "kwargs: " + json.dumps(kwargs, sort_keys=True))
        return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")


CASES = [
    ("plain", {"max_length": None, "label_key": "label"}, "data.jsonl"),
    ("templated_tools", {"max_length": None, "label_key": "label", "tool_key": "tools", "apply_chat_template": True,
                         "apply_chat_template_kwargs": {"enable_thinking": False}}, "data.jsonl@[0:3]"),
    ("filtered", {"max_length": 8, "label_key": "label", "apply_chat_template": True, "seed": 7}, "data.jsonl"),
    ("no_label_sliced", {"max_length": 3, "metadata_key": "meta"}, "data.jsonl@[-2:]"),
]


def run_all(Dataset, directory) -> dict:
    path = os.path.join(directory, "data.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in ROWS)
    out = {}
    for name, kwargs, file in CASES:
        kwargs = dict(kwargs)
        ds = Dataset(os.path.join(directory, file), WordTokenizer(), None, kwargs.pop("max_length"),
                     prompt_key="text", **kwargs)
        view = [{"prompt": s.prompt, "label": s.label, "metadata": s.metadata} for s in ds.samples]
        orders = []
        for epoch in (0, 1, 1, 3):
            ds.shuffle(epoch)
            orders.append([ds.origin_samples.index(s) for s in ds.samples] + [ds.epoch_id, len(ds)])
        out[name] = {"samples": view, "orders": orders, "first": ds[0].label if len(ds) else None}
    return out
