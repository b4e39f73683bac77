"""slime.utils.data.Dataset (upstream's prompt dataset, text prompts) against upstream's on the same files
(tests/data/dataset_cases.py; recorded by tests/data/record_upstream_dataset_cases.py at the commit it names):
prompts (templated with tools and template kwargs, or as given), labels, metadata with tools, long prompts filtered,
row slices, and the order after each shuffle. Multimodal rows are refused in one line."""

from __future__ import annotations

import json
import os
import sys

import pytest

from slime.utils.data import Dataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
from dataset_cases import WordTokenizer, run_all  # noqa: E402

with open(os.path.join(os.path.dirname(__file__), "data", "upstream_dataset_cases.json")) as f:
    RECORD = json.load(f)


def test_record_names_the_upstream_commit():
    assert RECORD["repository"] == "THUDM/slime" and len(RECORD["commit"]) == 40 and len(RECORD["cases"]) == 4


def test_cases_equal_upstream(tmp_path):
    ours = json.loads(json.dumps(run_all(Dataset, str(tmp_path))))
    for name, want in RECORD["cases"].items():
        assert ours[name] == want, name
    assert RECORD["cases"]["filtered"]["orders"][0] != RECORD["cases"]["filtered"]["orders"][3]  # shuffles move


def test_multimodal_rows_are_refused(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "<image> what?", "images": ["a.png"]}\n')
    with pytest.raises(NotImplementedError, match="multimodal prompts"):
        Dataset(str(path), WordTokenizer(), None, None, multimodal_keys={"image": "images"})
