"""The quick start's task: the "answer" prompts, whose warm-up teaches two forms (the bare copy and the copy after
the word `answer`) and whose reward pays only the second, so that GRPO, not the warm-up, carries the reward."""

from __future__ import annotations

import random

import pytest

from slime.rollout.sample import Sample, SampleStatus
from slime.rollout.synthetic import W_STOP, make_example, score, synthetic_reward, task_reward


def test_answer_prompt_and_label_are_a_copy():
    row = make_example(random.Random(3), "answer", 4, 4)
    symbols = row["prompt"].split()[2:-1]
    assert row["prompt"].startswith("answer : ") and row["prompt"].endswith(" =") and len(symbols) == 4
    assert row["label"] == " ".join(symbols) and row["metadata"] == {"task": "answer"}


@pytest.mark.parametrize("response, stopped, expected", [
    ("answer c a d", True, 1.0),  # the paid form, exact, stopped
    ("c a d", True, 0.0),  # the other form, exact: nothing
    ("answer c a d", False, 1.0 - W_STOP),  # hit the length limit: no stop credit
    ("answer c a b", True, 0.2 + 0.7 * 2 / 3 + 0.1),  # the copy inside the form is scored as the copy task's
    ("", True, 0.0),
    ("answer", True, 0.0),
    ("a answer c a d", True, 0.0),  # the word must come first
])
def test_answer_reward_pays_only_the_answer_form(response, stopped, expected):
    assert task_reward(response, "c a d", "answer", stopped) == pytest.approx(expected)


def test_other_tasks_keep_the_shaped_reward():
    rng = random.Random(0)
    for _ in range(200):
        got = " ".join(rng.choice("abcde") for _ in range(rng.randint(0, 6)))
        assert task_reward(got, "c a d", "copy", True) == score(got, "c a d")
    assert task_reward("c a d", "c a d", None, False) == pytest.approx(1.0 - W_STOP)


@pytest.mark.parametrize("response, status, expected", [
    ("answer c a d <eos>", SampleStatus.COMPLETED, 1.0),
    ("c a d <eos>", SampleStatus.COMPLETED, 0.0),
    ("answer c a d", SampleStatus.TRUNCATED, 1.0 - W_STOP),
])
def test_synthetic_reward_reads_the_task_from_the_sample_metadata(response, status, expected):
    s = Sample(group_index=0, index=0, prompt="p", label="c a d", response=response, status=status,
               metadata={"task": "answer"})
    assert synthetic_reward(None, s) == pytest.approx(expected)
    s.metadata = {"task": "copy"}  # the same response to a copy prompt: shaped, whatever the form
    assert synthetic_reward(None, s) == pytest.approx(task_reward(response.replace(" <eos>", ""), "c a d", "copy",
                                                                  status != SampleStatus.TRUNCATED))


def test_warmup_batches_teach_both_forms_in_their_shares():
    pytest.importorskip("torch")
    from slime.utils.tiny_tokenizer import build_tokenizer
    from slime_plugins.models.common.warmup import ANSWER_FORM_SHARE, _batch

    tok = build_tokenizer(512)
    word = tok.convert_tokens_to_ids("answer")
    rng, forms = random.Random(0), []
    for _ in range(20):
        ids, mask = _batch(tok, rng, ("answer", 3, 5, 0.0), 16)
        for row, m in zip(ids.tolist(), mask.tolist()):
            answer = [t for t, keep in zip(row, m) if keep]
            forms.append(answer[0] == word)
            symbols = answer[1:-1] if answer[0] == word else answer[:-1]
            assert answer[-1] == tok.eos_token_id and len(symbols) in (3, 4, 5)
            assert row[m.index(1) - 1] == tok.convert_tokens_to_ids("<|assistant|>")  # the answer follows the prompt
    assert abs(sum(forms) / len(forms) - ANSWER_FORM_SHARE) < 0.06, sum(forms) / len(forms)  # 320 examples


def test_report_reward_levels():
    from slime.report import reward_levels

    records = [{"rollout_id": i, "rollout/reward_mean": v} for i, v in enumerate([0.4, 0.5, 0.6, 0.5, 0.5, 0.7, 0.9,
                                                                                    0.9, 0.95, 0.9, 1.0])]
    evals = [{"eval_step": 0, "eval/answer/reward_mean": 0.45}, {"eval_step": 10, "eval/answer/reward_mean": 0.9}]
    levels = reward_levels(records, evals)
    assert levels["prior"] == 0.4 and levels["first"] == pytest.approx(0.5)
    assert levels["last"] == pytest.approx(0.93)
    assert levels["answer/before"] == 0.45 and levels["answer/after"] == 0.9


def test_training_prompts_leave_out_the_held_out_ones(tmp_path):
    from slime.rollout.synthetic import main

    held_out, train = tmp_path / "eval.jsonl", tmp_path / "data.jsonl"
    task = ["--tasks", "answer", "--min-len", "2", "--max-len", "4"]  # the quick start's
    main(["--out", str(held_out), "--num", "32", "--seed", "1", *task])
    main(["--out", str(train), "--num", "4096", "--seed", "0", *task, "--exclude", str(held_out)])
    import json

    held = {json.loads(x)["prompt"] for x in held_out.read_text().splitlines()}
    kept = [json.loads(x)["prompt"] for x in train.read_text().splitlines()]
    # 2-4 symbols over 5 letters make 775 strings: 4096 draws hit every held-out one, all of which are dropped
    assert not held & set(kept) and 3000 < len(kept) < 4096 and len(held) > 20
