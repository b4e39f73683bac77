"""Upstream's rollout loop (slime.rollout.sglang_rollout.generate_rollout) on its own, against a stand-in engine
whose requests for some prompts run until they are aborted: the first groups to finish are the batch, the
engine aborts the rest (partial responses come back), --partial-rollout gives those back to the data source
and the next rollout continues them from their tokens (--mask-offpolicy-in-partial-rollout masks the old part)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from json_http import JsonHandler, serve

PROMPTS = ["copy : a =", "copy : b =", "copy : c =", "copy : d ="]  # groups 1 and 3 (b, d) run until aborted


class StandInEngine(JsonHandler):
    slow: set = set()
    requests: list = []
    aborts: list = []
    aborted = threading.Event()

    def do_POST(self) -> None:
        body = self.body()
        if self.path == "/abort_request":
            self.aborts.append(body)
            self.aborted.set()
            return self.reply(200, {"success": True})
        ids, budget = body["input_ids"], body["sampling_params"]["max_new_tokens"]
        self.requests.append((list(ids), budget))
        if tuple(ids) in self.slow:  # a first request for b or d: runs until the rollout aborts it
            if not self.aborted.wait(timeout=30):
                return self.reply(500, {"error": {"message": "never aborted"}})
            out, finish = [7, 8], {"type": "abort", "message": "aborted"}
        else:
            out, finish = [9, 10, 11][:budget], {"type": "length", "length": min(3, budget)}
        self.reply(200, {"text": " ".join(map(str, out)), "output_ids": out, "meta_info": {
            "finish_reason": finish, "weight_version": "1", "prompt_tokens": len(ids), "completion_tokens": len(out),
            "output_token_logprobs": [[-0.5, t, None] for t in out]}})


def reward(args, sample):
    return 1.0


@pytest.fixture()
def setup(tmp_path):
    from slime.rollout.sglang_rollout import GenerateState
    from slime.utils.tiny_tokenizer import build_tokenizer

    tok = build_tokenizer(64)
    tok.save_pretrained(tmp_path / "tok")
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "label": "x"}) + "\n" for p in PROMPTS))
    StandInEngine.slow = {tuple(tok(PROMPTS[i], add_special_tokens=False)["input_ids"]) for i in (1, 3)}
    StandInEngine.requests, StandInEngine.aborts = [], []
    StandInEngine.aborted.clear()
    server, url = serve(StandInEngine)
    GenerateState.clear_instances()
    yield tok, str(data), tmp_path, url
    GenerateState.clear_instances()
    server.shutdown()


def _run(tok, data, tmp_path, url, **flags):
    from slime.config.rollout_args import rollout_defaults
    from slime.rollout.data_source import JsonlDataSource
    from slime.rollout.plugin_rollout import make_data_source, plugin_args
    from slime.utils.http_client import EngineClient
    from slime.utils.http_utils import init_http_client

    args = rollout_defaults(prompt_data=data, hf_checkpoint=str(tmp_path / "tok"), rollout_batch_size=2,
                            n_samples_per_prompt=2, over_sampling_batch_size=4, rollout_max_response_len=5,
                            custom_rm_path="tests.test_streaming_rollout:reward", **flags)
    args = plugin_args(args, url, 1, [EngineClient(url, None)])
    init_http_client(args)
    return args, make_data_source(args, JsonlDataSource(data, tok), tok)


def test_first_finished_groups_kept_rest_aborted_and_resumed(setup):
    from slime.rollout.sglang_rollout import generate_rollout
    from slime.utils.types import Sample

    tok, data, tmp_path, url = setup
    args, source = _run(tok, data, tmp_path, url, partial_rollout=True, mask_offpolicy_in_partial_rollout=True)
    prompt = {g: tok(PROMPTS[g], add_special_tokens=False)["input_ids"] for g in range(4)}
    t0 = time.perf_counter()
    out = generate_rollout(args, 0, source)
    assert time.perf_counter() - t0 < 10  # the slow requests ended by the abort, not their 30 s
    # groups 0 and 2 finished first (1 and 3 were submitted before 2): they are the batch
    assert [[s.group_index for s in g] for g in out.samples] == [[0, 0], [2, 2]]
    assert all(s.status == Sample.Status.TRUNCATED and s.reward == 1.0 for g in out.samples for s in g)
    assert StandInEngine.aborts and StandInEngine.aborts[0] == {"abort_all": True}
    # the rest came back with their tokens so far, given back to the data source
    assert sorted([s.group_index for s in g] for g in source.buffer) == [[1, 1], [3, 3]]  # (in abort order)
    for s in (s for g in source.buffer for s in g):
        assert s.status == Sample.Status.ABORTED and s.reward is None and s.metadata["start_rollout_id"] == 0
        assert s.tokens == prompt[s.group_index] + [7, 8] and s.rollout_log_probs == [-0.5, -0.5]

    StandInEngine.aborted.clear()
    args.over_sampling_batch_size = 2  # the two groups given back, nothing new
    sent = len(StandInEngine.requests)
    out = generate_rollout(args, 1, source)
    assert [[s.group_index for s in g] for g in out.samples] == [[1, 1], [3, 3]] and not source.buffer
    resumed = StandInEngine.requests[sent:]
    assert sorted(resumed) == sorted([(prompt[g] + [7, 8], 3) for g in (1, 3) for _ in range(2)])
    for s in (s for g in out.samples for s in g):
        assert s.tokens == prompt[s.group_index] + [7, 8, 9, 10, 11] and s.response_length == 5
        assert s.loss_mask == [0, 0, 1, 1, 1]  # the part from the earlier rollout's weights is masked
        assert s.rollout_log_probs == [-0.5] * 5 and s.status == Sample.Status.TRUNCATED and s.reward == 1.0


def test_without_partial_rollout_aborted_groups_are_dropped(setup):
    from slime.rollout.sglang_rollout import generate_rollout

    tok, data, tmp_path, url = setup
    args, source = _run(tok, data, tmp_path, url)
    out = generate_rollout(args, 0, source)
    assert [[s.group_index for s in g] for g in out.samples] == [[0, 0], [2, 2]]
    assert StandInEngine.aborts and not source.buffer


def test_built_in_runs_hand_these_flags_to_the_streaming_loop():
    from slime.config.rollout_args import rollout_defaults
    from slime.rollout.generate import RolloutError, generate_rollout
    from slime.rollout.plugin_rollout import uses_plugin_eval, uses_plugin_rollout

    assert not uses_plugin_rollout(rollout_defaults())
    for flag in ({"partial_rollout": True}, {"over_sampling_batch_size": 4},
                 {"dynamic_sampling_filter_path": "slime.rollout.filter_hub.dynamic_sampling_filters."
                                                  "check_reward_nonzero_std"}):
        args = rollout_defaults(rollout_batch_size=2, **flag)
        assert uses_plugin_rollout(args) and not uses_plugin_eval(args), flag  # evaluation stays built-in
        with pytest.raises(RolloutError, match="run by slime.rollout.sglang_rollout.generate_rollout"):
            generate_rollout(args, None, None, None, None)


def test_over_sampling_batch_size_below_the_rollout_batch_is_refused(tmp_path, capsys):
    from pathlib import Path

    from slime.config.arguments import parse_args

    cfg = Path(__file__).resolve().parents[1] / "scripts/models/configs/qwen3-4B.json"
    (tmp_path / "config.json").write_text(cfg.read_text())
    base = ["--hf-checkpoint", str(tmp_path), "--num-rollout", "1", "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "2"]
    assert parse_args([*base, "--over-sampling-batch-size", "4"]).over_sampling_batch_size == 4
    with pytest.raises(SystemExit):
        parse_args([*base, "--over-sampling-batch-size", "3"])
    assert "--over-sampling-batch-size 3 must be >= --rollout-batch-size 4" in capsys.readouterr().err


@pytest.mark.parametrize("outcome", ["cancelled", "failed", "done"])
def test_a_generation_job_that_ends_without_its_groups_fails_them(outcome):
    """The built-in groups' job (run_samples on a thread): if it fails or is cancelled, every group it had not
    finished fails with the cause, so the streaming loop raises instead of waiting for them forever."""
    import asyncio

    from slime.rollout.errors import RolloutError
    from slime.rollout.generate import _fail_unfinished

    async def run():
        loop = asyncio.get_running_loop()
        finished, unfinished, job = loop.create_future(), loop.create_future(), loop.create_future()
        finished.set_result(["group 0"])
        if outcome == "cancelled":
            job.cancel()
        elif outcome == "failed":
            job.set_exception(RolloutError("engine 1 lost sample 3"))
        else:
            job.set_result(None)
        _fail_unfinished([finished, unfinished], job)
        return finished, unfinished

    finished, unfinished = asyncio.run(run())
    assert finished.result() == ["group 0"]  # a settled group keeps its samples
    if outcome == "done":
        assert not unfinished.done()
    else:
        with pytest.raises(RolloutError, match="cancelled" if outcome == "cancelled" else "lost sample 3"):
            unfinished.result()
