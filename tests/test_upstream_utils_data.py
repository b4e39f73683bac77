"""slime.utils.data (upstream's path): read_file with PATH@[a:b] row slices on .jsonl and .parquet, upstream's
errors, filter_long_prompt, process_rollout_data's per-rank view and get_source. Expected values follow
upstream's code at 624b824a8 (slime/utils/data.py) on the same inputs."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from slime.utils.data import filter_long_prompt, get_source, process_rollout_data, read_file
from slime.utils.types import Sample

ROWS = [{"text": f"p{i}", "label": i} for i in range(7)]


@pytest.fixture(params=["jsonl", "parquet"])
def data_file(request, tmp_path):
    path = tmp_path / f"d.{request.param}"
    if request.param == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:3]) + "\n" +
                        "".join(json.dumps(r) + "\n" for r in ROWS[3:]))  # a blank line is skipped
    else:
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(ROWS), path)
    return str(path)


@pytest.mark.parametrize("suffix, rows", [("", range(7)), ("@[2:5]", range(2, 5)), ("@[:3]", range(3)),
                                          ("@[4:]", range(4, 7)), ("@[-2:]", range(5, 7)), ("@[1:-4]", range(1, 3)),
                                          ("@[-10:2]", range(2)), ("@[5:2]", [])])
def test_read_file_slices_like_python(data_file, suffix, rows):
    assert [r["label"] for r in read_file(data_file + suffix)] == list(rows)


def test_read_file_errors_are_upstreams(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"Prompt dataset path '.*nope.jsonl' does not exist\."):
        list(read_file(str(tmp_path / "nope.jsonl@[1:2]")))
    (tmp_path / "d.csv").write_text("a\n")
    with pytest.raises(ValueError, match=r"Unsupported file format: .*d\.csv\. Supported formats are \.jsonl"):
        list(read_file(str(tmp_path / "d.csv")))


class CharTokenizer:
    def __call__(self, prompts, add_special_tokens=False):
        return {"input_ids": [list(p) for p in prompts]}


def test_filter_long_prompt():
    samples = [Sample(index=i, prompt="x" * n) for i, n in enumerate([3, 5, 4, 6])]
    assert [s.index for s in filter_long_prompt(samples, CharTokenizer(), None, 4)] == [0, 2]
    assert filter_long_prompt(samples, CharTokenizer(), None, None) is samples
    listed = [Sample(index=0, prompt=[{"role": "user", "content": "x" * 9}])]
    assert filter_long_prompt(listed, CharTokenizer(), None, 2) is listed  # list prompts are not checked
    media = [Sample(index=0, prompt="xx", multimodal_inputs={"images": ["a.png"]})]
    with pytest.raises(NotImplementedError, match="multimodal"):
        filter_long_prompt(media, CharTokenizer(), object(), 4)


def test_process_rollout_data_gives_this_ranks_view(monkeypatch):
    ray = pytest.importorskip("ray")
    whole = {"partition": [1, 3], "total_lengths": [5, 6, 7, 8], "raw_reward": [0.0, 1.0, 0.5, 0.25]}
    fake_refs = [SimpleNamespace(inner="r0"), SimpleNamespace(inner="r1")]
    monkeypatch.setattr(ray, "get", lambda ref: dict(whole) if ref == "r1" else None)
    out = process_rollout_data(None, fake_refs, 1, 2)
    assert out["total_lengths"] == [6, 8] and out["local_raw_reward"] == [1.0, 0.25]
    assert out["raw_reward"] == whole["raw_reward"]
    with pytest.raises(ValueError, match="data-parallel size 3"):
        process_rollout_data(None, fake_refs, 0, 3)


def test_get_source():
    assert get_source(Sample(metadata={"source_name": "gsm8k"})) == "gsm8k"
    assert get_source(Sample()) == "unknown"
