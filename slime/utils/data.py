"""Upstream slime's `slime.utils.data` helpers that plugins import, over this project's prompt-file reader
(slime.rollout.prompt_files).

read_file(path): the records of a `.jsonl` or `.parquet` file, `PATH@[start:end]` selecting rows (Python slice
bounds, negative allowed). Where upstream prints and skips a line that is not JSON, this reader stops with one
line naming it (a silently shorter dataset is the worse surprise). `Dataset` is upstream's prompt dataset (text
prompts) for plugin code; this project's runs read prompts through their data sources (slime.rollout.data_source),
whose prompt templating and tool lists it shares.
"""

from __future__ import annotations

import logging
import os
import random
from typing import Any, Iterator

from slime.rollout.prompt_files import read_records, split_row_slice
from slime.utils.types import Sample

logger = logging.getLogger(__name__)


def read_file(path: str) -> Iterator[Any]:
    real_path, _ = split_row_slice(path)
    if not os.path.exists(real_path):
        raise FileNotFoundError(f"Prompt dataset path '{real_path}' does not exist.")
    if not real_path.endswith((".jsonl", ".parquet")):
        raise ValueError(f"Unsupported file format: {real_path}. Supported formats are .jsonl and .parquet.")
    for _, record in read_records(path):
        yield record


def filter_long_prompt(origin_samples: list[Sample], tokenizer, processor, max_length: int | None) -> list[Sample]:
    """The samples whose (templated, string) prompt is at most max_length tokens, in order; list prompts (not
    templated) are kept unchecked, as upstream. Samples with images or other media need upstream's vision
    processing, which is not provided here: they are refused."""
    if max_length is None:
        return origin_samples
    if not isinstance(origin_samples[0].prompt, str):
        logger.warning("Skipping max_length check for list prompt. Set apply_chat_template=True to enable "
                       "length filtering.")
        return origin_samples
    if processor is not None and any(s.multimodal_inputs and any(v is not None for v in s.multimodal_inputs.values())
                                     for s in origin_samples):
        raise NotImplementedError("filter_long_prompt: samples with multimodal inputs need a vision processor "
                                  "pass, which this project does not provide; filter text-only samples")
    ids = tokenizer([s.prompt for s in origin_samples], add_special_tokens=False)["input_ids"]
    kept = [s for s, tokens in zip(origin_samples, ids, strict=True) if len(tokens) <= max_length]
    logger.info(f"Filtered {len(origin_samples) - len(kept)} samples longer than max_length={max_length}.")
    return kept


def process_rollout_data(args, rollout_data_ref, dp_rank: int, dp_size: int) -> dict:
    """One data-parallel rank's rollout data from upstream's per-rank references (objects whose `.inner` is a
    Ray object ref of the whole batch's dict, with `partition`: this rank's sample positions): total_lengths
    narrowed to this rank's samples, `local_raw_reward` added beside the whole `raw_reward`."""
    import ray

    if len(rollout_data_ref) != dp_size:
        raise ValueError(f"{len(rollout_data_ref)} rollout data references for data-parallel size {dp_size}")
    data = ray.get(rollout_data_ref[dp_rank].inner)
    partition = data["partition"]
    data["total_lengths"] = [data["total_lengths"][i] for i in partition]
    if "raw_reward" in data:
        data["local_raw_reward"] = [data["raw_reward"][i] for i in partition]
    return data


def get_source(sample: Sample) -> str:
    """The dataset a sample came from: its `source`, else metadata["source_name"], else "unknown"."""
    metadata = sample.metadata or {}
    source = getattr(sample, "source", None)
    if source:
        return source
    return metadata.get("source_name") or "unknown"


class Dataset:
    """Upstream's prompt dataset: every row of `path` (`.jsonl` / `.parquet`, `PATH@[a:b]` row slices) as a
    Sample (prompt, label, metadata with the row's tools), the prompt templated with `apply_chat_template` (a string
    prompt as one user message), prompts over `max_length` tokens dropped; `shuffle(epoch)` reorders them with
    `seed + epoch`. Text prompts only: rows with multimodal inputs (`multimodal_keys`, a processor) need upstream's
    vision processing, which this project does not provide; they are refused."""

    def __init__(self, path, tokenizer, processor, max_length, *, prompt_key="text", multimodal_keys=None,
                 label_key=None, tool_key=None, metadata_key="metadata", seed=42, apply_chat_template=False,
                 apply_chat_template_kwargs=None):
        from slime.rollout.data_source import _tools, prompt_text

        if multimodal_keys is not None or processor is not None:
            raise NotImplementedError("Dataset: multimodal prompts (multimodal_keys, a processor) need upstream's "
                                      "vision processing, which this project does not provide; use text prompts")
        samples = []
        for row_number, row in enumerate(read_file(path)):
            prompt = row.get(prompt_key)
            metadata = row.get(metadata_key) or {}
            tools = _tools(row, tool_key, f"{path} row {row_number}")
            if tools is not None:
                metadata["tools"] = tools
            if apply_chat_template:
                prompt = prompt_text(tokenizer, prompt, True, apply_chat_template_kwargs, tools)
            samples.append(Sample(prompt=prompt, label=row[label_key] if label_key is not None else None,
                                  metadata=metadata))
        self.origin_samples = filter_long_prompt(samples, tokenizer, processor, max_length)
        self.samples = self.origin_samples
        self.epoch_id = -1
        self.seed = seed

    def shuffle(self, new_epoch_id):
        """The samples in the order of epoch `new_epoch_id` (a permutation seeded by seed + epoch; the same epoch
        twice changes nothing)."""
        if self.epoch_id == new_epoch_id:
            return
        order = list(range(len(self.samples)))
        random.Random(self.seed + new_epoch_id).shuffle(order)
        self.samples = [self.origin_samples[i] for i in order]
        self.epoch_id = new_epoch_id

    def __getitem__(self, idx):
        return self.samples[idx]

    def __len__(self):
        return len(self.samples)
