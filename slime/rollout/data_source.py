"""Prompts from a JSONL or parquet file (slime.rollout.prompt_files): tokenized once, served in (optionally shuffled) epochs, resumable.

Each line is a JSON object; `--input-key` holds the prompt (a string, or a list of chat messages
{"role", "content"}), `--label-key` the reference answer for the reward. With
`--apply-chat-template` a string prompt becomes one user message and the tokenizer's chat
template (with the generation prompt) is applied; the sample's `prompt` is then that templated text, as
upstream's. Shuffling is a permutation seeded by
`--rollout-seed` + epoch, so a resumed run sees exactly the prompts it would have seen.

`RolloutDataSourceWithBuffer` / `DataSource` are upstream slime's data-source API (`--data-source-path`)
over the same prompts: `get_samples(n)` -> n groups of fresh Samples, `add_samples(groups)` gives some back.
"""

from __future__ import annotations

import abc
import json
import os
import random
from dataclasses import dataclass
from typing import Any

from slime.utils.misc import load_function
from slime.utils.types import Sample


class DataSourceError(ValueError):
    """Bad prompt data or data-source state. One line: the problem and the fix."""


@dataclass
class PromptItem:
    group_index: int
    prompt: Any
    prompt_ids: list[int]
    label: Any
    metadata: dict[str, Any]


def make_samples(items: list[PromptItem], n_per_prompt: int, indices: range) -> list[Sample]:
    """`n_per_prompt` fresh samples of each prompt, in order, numbered from `indices`."""
    it = iter(indices)
    return [Sample(group_index=p.group_index, index=next(it), prompt=p.prompt,
                   tokens=list(p.prompt_ids), label=p.label, metadata=dict(p.metadata))
            for p in items for _ in range(n_per_prompt)]


def prompt_text(tokenizer: Any, prompt: Any, apply_chat_template: bool,
                chat_template_kwargs: dict[str, Any] | None = None, tools: list | None = None) -> str:
    """The text the engine is prompted with: with --apply-chat-template the chat template's rendering (a string
    prompt as one user message, with the generation prompt), else the prompt string itself."""
    if apply_chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        # --apply-chat-template-kwargs (e.g. {"enable_thinking": false}) reach the template as upstream passes them
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                             **(chat_template_kwargs or {}))
    if isinstance(prompt, str):
        return prompt
    raise DataSourceError("prompt is a list of chat messages: pass --apply-chat-template")


def tokenize_prompt(tokenizer: Any, prompt: Any, apply_chat_template: bool,
                    chat_template_kwargs: dict[str, Any] | None = None, tools: list | None = None) -> list[int]:
    text = prompt_text(tokenizer, prompt, apply_chat_template, chat_template_kwargs, tools)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _tools(rec: dict, tool_key: str | None, where: str) -> list | None:
    """--tool-key's tool list of a prompt (a list, or its JSON text), or None."""
    if not tool_key or rec.get(tool_key) is None:
        return None
    tools = rec[tool_key]
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise DataSourceError(f"{where}: {tool_key!r} is not a JSON list of tools ({e.msg})") from e
    if not isinstance(tools, list):
        raise DataSourceError(f"{where}: {tool_key!r} must be a list of tools, got {type(tools).__name__}")
    return tools


class JsonlDataSource:
    def __init__(self, path: str, tokenizer: Any, input_key: str = "prompt", label_key: str | None = "label",
                 metadata_key: str | None = "metadata", apply_chat_template: bool = False, shuffle: bool = False,
                 seed: int = 42, max_prompt_len: int | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None, tool_key: str | None = None,
                 whole_chats: bool = False) -> None:
        """whole_chats: a list-of-messages prompt is a whole conversation to train on (SFT), measured by its
        full chat-template rendering instead of being refused without --apply-chat-template."""
        from slime.rollout.prompt_files import PromptFileError, read_records

        self.path, self.shuffle, self.seed = path, shuffle, seed
        self.items: list[tuple[Any, list[int], Any, dict]] = []
        dropped = 0
        try:
            for where, rec in read_records(path):  # .jsonl or .parquet, optionally PATH@[start:end]
                if not isinstance(rec, dict) or input_key not in rec:
                    raise DataSourceError(f"{where} has no key {input_key!r}; set --input-key to the prompt's key")
                prompt = rec[input_key]
                tools = _tools(rec, tool_key, where)
                if whole_chats and isinstance(prompt, list):
                    ids = list(tokenizer.apply_chat_template(prompt, tools=tools, tokenize=True, return_dict=False))
                else:
                    # the sample's prompt is the templated text under --apply-chat-template, as upstream's
                    prompt = prompt_text(tokenizer, prompt, apply_chat_template, chat_template_kwargs, tools)
                    ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
                if not ids:
                    raise DataSourceError(f"{where}: the prompt tokenizes to nothing")
                if max_prompt_len is not None and len(ids) > max_prompt_len:
                    dropped += 1
                    continue
                meta = rec.get(metadata_key) if metadata_key else None
                meta = dict(meta) if isinstance(meta, dict) else {}
                if tools is not None:
                    meta["tools"] = tools  # as upstream: custom generate functions read them there
                self.items.append((prompt, ids, rec.get(label_key) if label_key else None, meta))
        except PromptFileError as e:
            raise DataSourceError(str(e)) from e
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


def prompt_source(args: Any, tokenizer: Any) -> JsonlDataSource:
    """--prompt-data read as the flags say (keys, chat template, shuffle, length limit, tools)."""
    return JsonlDataSource(args.prompt_data, tokenizer, args.input_key, args.label_key, args.metadata_key,
                           args.apply_chat_template, args.rollout_shuffle, args.rollout_seed,
                           args.rollout_max_prompt_len, args.apply_chat_template_kwargs, args.tool_key,
                           whole_chats=getattr(args, "loss_type", None) == "sft_loss")


# ------------------------------------------------------------------ upstream slime's data-source API
class DataSource(abc.ABC):
    """`--data-source-path` contract (upstream's): groups of samples to generate, and a way to give some back."""

    @abc.abstractmethod
    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """`num_samples` prompt groups, each of --n-samples-per-prompt samples."""

    @abc.abstractmethod
    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Groups to serve again (e.g. partial rollouts aborted at the end of a rollout)."""

    @abc.abstractmethod
    def save(self, rollout_id: int) -> None: ...

    @abc.abstractmethod
    def load(self, rollout_id: int | None = None) -> None: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...


class RolloutDataSource(DataSource):
    """--prompt-data as upstream's data source: prompts become groups of fresh samples (indices unique over
    the run); its position is this project's JsonlDataSource state (saved in checkpoints by the manager).
    Under --disable-rollout-global-dataset (args.rollout_global_dataset False) it reads no prompts, as upstream's:
    get_samples gives groups of empty Samples (numbered) for the rollout function to fill, and save/load keep
    nothing."""

    def __init__(self, args: Any, tokenizer: Any = None, source: JsonlDataSource | None = None) -> None:
        self.args = args
        self._next_group, self._next_index = 0, 0  # numbering of the empty samples without a global dataset
        if source is None and getattr(args, "rollout_global_dataset", True):
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
            source = prompt_source(args, tokenizer)
        self.source = source

    def _empty_groups(self, num_samples: int, n: int) -> list[list[Sample]]:
        groups = []
        for _ in range(num_samples):
            groups.append([Sample(group_index=self._next_group, index=self._next_index + j) for j in range(n)])
            self._next_group += 1
            self._next_index += n
        return groups

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        n = int(self.args.n_samples_per_prompt)
        if self.source is None:
            return self._empty_groups(num_samples, n)
        items = self.source.next_batch(num_samples)
        samples = make_samples(items, n, self.source.take_sample_indices(len(items) * n))
        return [samples[i:i + n] for i in range(0, len(samples), n)]

    def add_samples(self, samples: list[list[Sample]]) -> None:
        raise DataSourceError("RolloutDataSource keeps no buffer; use RolloutDataSourceWithBuffer to give groups back")

    def _state_path(self, rollout_id: int, directory: str | None) -> str | None:
        return os.path.join(directory, "rollout", f"data_source_{rollout_id}.json") if directory else None

    def save(self, rollout_id: int) -> None:
        path = self._state_path(rollout_id, getattr(self.args, "save", None))
        if path is None or self.source is None:
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(self.source.state_dict(), f)
        os.replace(path + ".tmp", path)

    def load(self, rollout_id: int | None = None) -> None:
        path = self._state_path(rollout_id, getattr(self.args, "load", None)) if rollout_id is not None else None
        if path and self.source is not None and os.path.exists(path):
            with open(path) as f:
                self.source.load_state_dict(json.load(f))

    def __len__(self) -> int:
        return 0 if self.source is None else len(self.source)


class RolloutDataSourceWithBuffer(RolloutDataSource):
    """Upstream's default: groups given back with add_samples are served first (through --buffer-filter-path,
    `fn(args, rollout_id, buffer, num_samples) -> groups`, default the oldest first)."""

    def __init__(self, args: Any, tokenizer: Any = None, source: JsonlDataSource | None = None) -> None:
        super().__init__(args, tokenizer, source)
        self.buffer: list[list[Sample]] = []
        self.metadata: dict[str, Any] = {}
        path = getattr(args, "buffer_filter_path", None)
        self.buffer_filter = load_function(path) if path else pop_first

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        from_buffer = self.buffer_filter(self.args, None, self.buffer, num_samples) if self.buffer else []
        return list(from_buffer) + (super().get_samples(num_samples - len(from_buffer))
                                    if num_samples > len(from_buffer) else [])

    def add_samples(self, samples: list[list[Sample]]) -> None:
        for group in samples:
            if len(group) != int(self.args.n_samples_per_prompt):
                raise DataSourceError(f"add_samples takes groups of --n-samples-per-prompt "
                                      f"({self.args.n_samples_per_prompt}) samples, got one of {len(group)}")
            self.buffer.append(group)

    def update_metadata(self, metadata: dict) -> None:
        self.metadata.update(metadata)

    def get_metadata(self) -> dict:
        return self.metadata

    def get_buffer_length(self) -> int:
        return len(self.buffer)


def pop_first(args: Any, rollout_id: Any, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    """The default buffer filter: the oldest `num_samples` groups, removed from the buffer."""
    taken = buffer[:num_samples]
    del buffer[:num_samples]
    return taken
