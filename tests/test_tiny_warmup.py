"""The supervised warm-up of the tiny checkpoint (slime_plugins/models/common/warmup.py): seeded, and it
gives the model a prior on the synthetic task that random init has not."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def _model(seed: int = 0):
    from transformers import AutoModelForCausalLM

    from slime_plugins.models.glm5.tiny import tiny_config

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer():
    from slime.utils.tiny_tokenizer import build_tokenizer

    return build_tokenizer(512)


def test_warmup_is_deterministic_for_a_seed(tokenizer):
    from slime_plugins.models.common.warmup import warmup

    a, b, c = _model(), _model(), _model()
    la = warmup(a, tokenizer, 4, seed=3, batch_size=8)
    lb = warmup(b, tokenizer, 4, seed=3, batch_size=8)
    warmup(c, tokenizer, 4, seed=4, batch_size=8)
    assert la == lb
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)  # another seed, other batches


def test_warmup_prints_progress_and_a_summary(tokenizer, capsys, monkeypatch):
    """The quick start writes its model before Ray starts: the warm-up says where it is (stderr) while it runs."""
    from slime_plugins.models.common import warmup as warmup_module

    monkeypatch.setattr(warmup_module, "PROGRESS_EVERY_S", 0.0)
    losses = warmup_module.warmup(_model(), tokenizer, 3, seed=0, batch_size=4)
    err = capsys.readouterr().err.splitlines()
    assert [line.split(",")[0].strip() for line in err[:2]] == ["warm-up step 1/3", "warm-up step 2/3"]
    assert err[-1].strip().startswith("warm-up: 3 steps in") and f"{losses[-1]:.3f}" in err[-1]


def test_warmed_model_scores_above_random_init_on_held_out_prompts(tokenizer):
    """60 steps of the default warm-up (the quick start runs 150) lift the greedy `--rm-type synthetic` reward
    on 32 held-out copy prompts (another data seed) from ~0 (random init: no letters) by more than 0.2."""
    from slime.rollout.synthetic import make_dataset
    from slime_plugins.models.common.warmup import mean_reward, warmup

    rows = make_dataset(32, seed=1)
    model = _model()
    before = mean_reward(model, tokenizer, rows, temperature=0)
    losses = warmup(model, tokenizer, 60, seed=0)
    after = mean_reward(model, tokenizer, rows, temperature=0)
    assert before < 0.05
    assert after > before + 0.2, (before, after)
    assert sum(losses[-10:]) < sum(losses[:10])


@pytest.mark.parametrize("spec, error", [
    ("sort", "bad warm-up task 'sort'"),
    ("copy:5-3", "bad warm-up task 'copy:5-3'"),
    ("copy:a-b", "lengths are min-max"),
    ("copy@2", "probability in [0, 1]"),
    (",", "no warm-up task given"),
])
def test_bad_warmup_task_spec_is_one_clear_error(spec, error):
    from slime_plugins.models.common.warmup import parse_tasks

    with pytest.raises(ValueError, match=error.replace("[", r"\[").replace("]", r"\]")):
        parse_tasks(spec)


def test_task_spec_parses_lengths_and_noise():
    from slime_plugins.models.common.warmup import parse_tasks

    assert parse_tasks("reverse, copy:1-2@0.5,copy:4") == [("reverse", 3, 5, 0.0), ("copy", 1, 2, 0.5),
                                                           ("copy", 4, 4, 0.0)]


@pytest.mark.parametrize("response, status, expected", [
    ("c a d <eos>", "COMPLETED", 1.0),  # the engine's text of an exact answer that stopped: full credit
    ("c a d", "TRUNCATED", 0.9),  # the same symbols at the length limit: no stop credit
    ("c a d b <eos>", "COMPLETED", 0.9),  # one symbol too many
    ("c a <eos>", "COMPLETED", 0.2 * 2 / 3 + 0.7 * 2 / 3),  # stopped early: the EOS is not a symbol
])
def test_synthetic_reward_reads_the_eos_of_a_stopped_response_as_the_stop(response, status, expected):
    """The rollout's response text keeps special tokens (no --rollout-skip-special-tokens), so the quick start's
    answers that stop end with `<eos>`; scored as a symbol, it would make the stop credit unreachable."""
    from slime.rollout.sample import Sample, SampleStatus
    from slime.rollout.synthetic import synthetic_reward

    s = Sample(group_index=0, index=0, prompt="p", label="c a d", response=response, status=SampleStatus[status])
    assert synthetic_reward(None, s) == pytest.approx(expected)


def test_glm5_next_warmup_forward_equals_the_default_forward(tokenizer):
    """The tiny GLM-5.3-Flash's warm-up forward (16-token KDA chunks, FORWARD_KWARGS) gives the default forward's
    loss and gradients (transformers' 64-token chunks) on a warm-up batch: the quick start's checkpoint is what
    the default forward would have trained, within float32 rounding."""
    import random

    from transformers import AutoModelForImageTextToText

    from slime_plugins.models.common.tiny import tiny_config
    from slime_plugins.models.common.warmup import _batch, forward_kwargs, parse_tasks

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(tiny_config("glm5_next"), dtype=torch.float32)
    assert forward_kwargs(model) == {"chunk_size": 16}
    ids, mask = _batch(tokenizer, random.Random(3), parse_tasks("answer:2-4")[0], 6)
    results = []
    for kwargs in ({}, forward_kwargs(model)):
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, **kwargs).logits[:, :-1]
        target = ids[:, 1:].masked_fill(~mask[:, 1:], -100)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-6)
    assert grads_a.keys() == grads_b.keys() and any("linear_attn" in n or "conv1d" in n for n in grads_a)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-6, msg=name)
