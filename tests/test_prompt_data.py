"""Prompt data as upstream reads it: .parquet and .jsonl files (row slices PATH@[a:b]), --apply-chat-template-kwargs,
--rollout-max-context-len, --rollout-stop, --rollout-skip-special-tokens, --start-rollout-id."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime.config.rollout_args import rollout_defaults

ROWS = [{"prompt": f"copy : {c} =", "label": c, "metadata": {"i": i}} for i, c in enumerate("abcdefg")]


@pytest.fixture(scope="module")
def tokenizer():
    from slime.utils.tiny_tokenizer import build_tokenizer

    return build_tokenizer(512)


def _files(tmp_path: Path) -> tuple[str, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet, row_group_size=3)  # several batches
    return str(jsonl), str(parquet)


def _items(ds) -> list[tuple]:
    return [(p.prompt, p.prompt_ids, p.label, p.metadata) for p in ds.next_batch(len(ds))]


@pytest.mark.parametrize("rows", ["", "@[2:5]", "@[-3:]", "@[:2]"])
def test_parquet_and_jsonl_give_the_same_prompts(tmp_path, tokenizer, rows):
    from slime.rollout.data_source import JsonlDataSource

    jsonl, parquet = _files(tmp_path)
    a = _items(JsonlDataSource(jsonl + rows, tokenizer, apply_chat_template=True))
    b = _items(JsonlDataSource(parquet + rows, tokenizer, apply_chat_template=True))
    want = ROWS[{"": slice(None), "@[2:5]": slice(2, 5), "@[-3:]": slice(-3, None), "@[:2]": slice(0, 2)}[rows]]
    assert a == b and [x[2] for x in a] == [r["label"] for r in want]
    assert [x[3] for x in a] == [r["metadata"] for r in want]


def test_preflight_reads_parquet_and_names_the_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from slime.config.preflight import PreflightError, PreflightReport, check_prompts

    _, parquet = _files(tmp_path)
    report = PreflightReport()
    check_prompts(rollout_defaults(prompt_data=parquet, rm_type="math"), report)
    assert (report.prompts, report.labelled) == (7, 7)
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "x", "label": "1"}, {"prompt": "y", "label": None}]), bad)
    with pytest.raises(PreflightError, match=r"bad.parquet row 1 has no label 'label'"):
        check_prompts(rollout_defaults(prompt_data=str(bad), rm_type="math"), PreflightReport())
    with pytest.raises(PreflightError, match="not a readable parquet file"):
        (tmp_path / "junk.parquet").write_text("not parquet")
        check_prompts(rollout_defaults(prompt_data=str(tmp_path / "junk.parquet"), rm_type="math"), PreflightReport())


def test_chat_template_kwargs_reach_the_template(tmp_path, tokenizer):
    import copy

    from slime.rollout.data_source import JsonlDataSource

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}")
    jsonl, _ = _files(tmp_path)
    plain = JsonlDataSource(jsonl, tok, apply_chat_template=True).next_batch(1)[0].prompt_ids
    off = JsonlDataSource(jsonl, tok, apply_chat_template=True,
                          chat_template_kwargs={"enable_thinking": False}).next_batch(1)[0].prompt_ids
    assert off[:len(plain)] == plain and off[len(plain):] == tok(" /no_think", add_special_tokens=False)["input_ids"]


def _parse(tmp_path: Path, *extra: str):
    from slime.config.arguments import parse_args

    cfg = Path(__file__).resolve().parents[1] / "scripts/models/configs/qwen3-4B.json"
    (tmp_path / "config.json").write_text(cfg.read_text())
    return parse_args(["--hf-checkpoint", str(tmp_path), "--num-rollout", "4", "--rollout-batch-size", "2",
                       "--n-samples-per-prompt", "2", *extra])


def test_context_len_bounds_the_prompt_len(tmp_path, capsys):
    args = _parse(tmp_path, "--rollout-max-context-len", "64", "--apply-chat-template-kwargs", '{"enable_thinking": false}')
    assert args.rollout_max_prompt_len == 63 and args.apply_chat_template_kwargs == {"enable_thinking": False}
    assert _parse(tmp_path).apply_chat_template_kwargs == {}
    for extra, needle in ((["--rollout-max-context-len", "64", "--rollout-max-prompt-len", "64"], "leaves no response"),
                          (["--apply-chat-template-kwargs", "[1]"], "must be a JSON object"),
                          (["--start-rollout-id", "4"], "--start-rollout-id 4 must be in [0, --num-rollout)")):
        with pytest.raises(SystemExit):
            _parse(tmp_path, *extra)
        assert needle in capsys.readouterr().err


def test_stop_strings_and_special_tokens_follow_the_flags(tokenizer):
    from slime.rollout.generate import _finish_sample, sampling_params
    from slime.rollout.sample import Sample

    p = sampling_params(rollout_defaults(rollout_stop=["\n\n", "</answer>"]), 1)
    assert p["stop"] == ["\n\n", "</answer>"] and p["skip_special_tokens"] is False
    assert sampling_params(rollout_defaults(rollout_skip_special_tokens=True), 1)["skip_special_tokens"] is True
    ids = tokenizer("a b", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    out = {"output_ids": ids, "meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.1, t, None] for t in ids]}}
    texts = []
    for skip in (False, True):
        s = Sample(index=0, tokens=[5, 6])
        _finish_sample(s, out, 0, tokenizer, skip)
        texts.append(s.response)
    assert texts[0] == tokenizer.decode(ids) and texts[1] == tokenizer.decode(ids[:-1])
    assert tokenizer.eos_token in texts[0] and tokenizer.eos_token not in texts[1]


def test_tool_key_reaches_the_template_and_the_metadata(tmp_path, tokenizer):
    import copy

    from slime.rollout.data_source import DataSourceError, JsonlDataSource

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% if tools %}{% for t in tools %}{{ t['name'] }} {% endfor %}{% endif %}"
                         "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    path = tmp_path / "t.jsonl"
    rows = [{"prompt": "copy : a =", "tools": [{"name": "ab"}]}, {"prompt": "copy : a =", "tools": '[{"name": "b"}]'},
            {"prompt": "copy : a ="}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = JsonlDataSource(str(path), tok, apply_chat_template=True, tool_key="tools").next_batch(3)
    bare = tok("copy : a =", add_special_tokens=False)["input_ids"]
    assert items[0].prompt_ids == tok("ab copy : a =", add_special_tokens=False)["input_ids"]
    assert items[1].prompt_ids == tok("b copy : a =", add_special_tokens=False)["input_ids"]
    assert items[2].prompt_ids == bare and "tools" not in items[2].metadata
    assert items[1].metadata["tools"] == [{"name": "b"}]
    path.write_text(json.dumps({"prompt": "x", "tools": {"name": "a"}}) + "\n")
    with pytest.raises(DataSourceError, match="'tools' must be a list of tools"):
        JsonlDataSource(str(path), tok, apply_chat_template=True, tool_key="tools")


def test_eval_context_len_defaults_to_the_rollouts(tmp_path):
    args = _parse(tmp_path, "--rollout-max-context-len", "64")
    assert (args.eval_max_context_len, args.eval_max_prompt_len) == (64, 63)
    args = _parse(tmp_path, "--eval-max-context-len", "32", "--eval-max-prompt-len", "8")
    assert (args.eval_max_context_len, args.eval_max_prompt_len, args.rollout_max_prompt_len) == (32, 8, None)


# ChatML as Qwen2 / SmolLM2-Instruct tokenizers ship it (a default system turn when the chat has none).
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_apply_chat_template_puts_the_templated_text_in_sample_prompt(tmp_path):
    """--apply-chat-template: Sample.prompt is the chat template's text (as upstream's data loading makes it) and
    its tokens are that text's; without the flag the prompt stays the raw string. A tokenizer saved and loaded
    from disk as a run loads it (AutoTokenizer over --hf-checkpoint), with a ChatML template."""
    from transformers import AutoTokenizer

    from slime.config.rollout_args import rollout_defaults
    from slime.rollout.data_source import JsonlDataSource, RolloutDataSourceWithBuffer
    from slime.utils.tiny_tokenizer import build_tokenizer

    tok = build_tokenizer(64)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "system", "user", "assistant"]})
    tok.chat_template = CHATML
    tok.save_pretrained(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    rows = [{"prompt": "copy : a b =", "label": "a b"},
            {"prompt": [{"role": "system", "content": "answer"}, {"role": "user", "content": "sort : b a ="}], "label": "a b"}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    want = ["<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\ncopy : a b =<|im_end|>\n"
            "<|im_start|>assistant\n",
            "<|im_start|>system\nanswer<|im_end|>\n<|im_start|>user\nsort : b a =<|im_end|>\n<|im_start|>assistant\n"]
    args = rollout_defaults(prompt_data=str(path), apply_chat_template=True, n_samples_per_prompt=2)
    groups = RolloutDataSourceWithBuffer(args, tok, JsonlDataSource(str(path), tok, apply_chat_template=True)).get_samples(2)
    for group, text in zip(groups, want):
        assert [s.prompt for s in group] == [text, text]
        assert group[0].tokens == tok(text, add_special_tokens=False)["input_ids"]
        pieces = tok.convert_ids_to_tokens(group[0].tokens)
        assert pieces[:2] == ["<|im_start|>", "system"] and pieces[-2:] == ["<|im_start|>", "assistant"]
        assert pieces.count("<|im_start|>") == 3 and pieces.count("<|im_end|>") == 2
    plain = JsonlDataSource(str(path) + "@[0:1]", tok).next_batch(1)[0]
    assert plain.prompt == "copy : a b =" and plain.prompt_ids == tok("copy : a b =", add_special_tokens=False)["input_ids"]
