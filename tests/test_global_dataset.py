"""--disable-rollout-global-dataset (upstream's dest rollout_global_dataset): no prompts read from --prompt-data;
the rollout function gets groups of empty, numbered Samples from the data source and manages the data itself."""

from __future__ import annotations

import pytest

from slime.config.rollout_args import RolloutArgumentError, rollout_defaults, validate_rollout_args
from slime.utils.types import Sample

MISSING = "/nonexistent/prompts.jsonl"


def make_own_prompts(args, rollout_id, data_source, evaluation=False):
    """A rollout function that manages its data: it fills the empty samples it is given."""
    groups = data_source.get_samples(args.rollout_batch_size)
    for group in groups:
        for s in group:
            assert s.prompt == "" and s.tokens == [] and s.label is None
            s.tokens = [1, 2, 3, 4 + s.index]
            s.response_length, s.loss_mask, s.rollout_log_probs = 1, [1], [-0.5]
            s.reward, s.status = float(s.group_index), Sample.Status.COMPLETED
    return groups


def _args(**kw):
    flags = dict(rollout_global_dataset=False, prompt_data=MISSING, rollout_batch_size=2, n_samples_per_prompt=3,
                 rollout_function_path="tests.test_global_dataset:make_own_prompts")
    return rollout_defaults(**{**flags, **kw})


def test_flag_parses_to_upstreams_dest():
    from slime.config.arguments import build_parser

    assert build_parser().parse_args([]).rollout_global_dataset is True
    assert build_parser().parse_args(["--disable-rollout-global-dataset"]).rollout_global_dataset is False


def test_data_source_reads_no_prompts_and_numbers_empty_groups(tmp_path):
    from slime.rollout.data_source import DataSourceError, RolloutDataSourceWithBuffer

    with pytest.raises(DataSourceError):  # with the global dataset the missing file is read (and refused)
        RolloutDataSourceWithBuffer(rollout_defaults(prompt_data=MISSING, n_samples_per_prompt=3), object())
    args = _args(save=str(tmp_path / "ck"))
    ds = RolloutDataSourceWithBuffer(args, object())
    first, second = ds.get_samples(2), ds.get_samples(1)
    assert [[s.index for s in g] for g in first + second] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert [g[0].group_index for g in first + second] == [0, 1, 2] and len(ds) == 0
    ds.save(0)
    ds.load(0)
    assert not (tmp_path / "ck").exists()  # nothing to save (upstream's save/load return at once)
    ds.add_samples([first[0]])
    assert ds.get_samples(1) == [first[0]]  # the buffer still works


def test_plugin_rollout_runs_on_the_functions_own_data():
    from slime.rollout.plugin_rollout import make_data_source, plugin_args, run_plugin_rollout

    args = validate_rollout_args(_args(rm_type="math"))
    args = plugin_args(args, None, 0)
    samples, metrics = run_plugin_rollout(args, 0, make_data_source(args, None, object()))
    assert [s.index for s in samples] == list(range(6)) and [s.reward for s in samples] == [0.0] * 3 + [1.0] * 3
    assert metrics["rollout/response_tokens"] == 6.0


def test_rollout_manager_makes_no_prompt_source():
    from slime.rollout.data_path import global_prompt_source

    args = _args()
    assert global_prompt_source(args, object()) is None  # would read (and fail on) the missing file otherwise
    args.rollout_global_dataset = True
    with pytest.raises(Exception, match="nonexistent"):
        global_prompt_source(args, object())


@pytest.mark.parametrize("overrides, needle", [
    ({"rollout_function_path": None}, "name the --rollout-function-path that manages its data"),
    ({"rollout_function_path": "slime.rollout.sglang_rollout.generate_rollout"}, "upstream's generate_rollout reads"),
])
def test_refused_without_a_rollout_function_that_manages_data(overrides, needle):
    with pytest.raises(RolloutArgumentError, match="--disable-rollout-global-dataset") as e:
        validate_rollout_args(_args(**overrides))
    assert needle in str(e.value)


def test_upstreams_default_rollout_function_refuses_it():
    from slime.rollout.sglang_rollout import generate_rollout

    with pytest.raises(ValueError, match="--disable-rollout-global-dataset"):
        generate_rollout(_args(), 0, None)


def test_num_epoch_needs_num_rollout_without_the_global_dataset():
    from slime.config.arguments import ArgumentError, _set_num_rollout_from_epochs

    with pytest.raises(ArgumentError, match="pass --num-rollout"):
        _set_num_rollout_from_epochs(_args(num_epoch=2, num_rollout=None))
