"""Upstream slime's plugin API end to end on CPU: custom functions written against upstream's contracts
(tests/upstream_plugins.py) drive 3 RL iterations each with the tiny GLM-5 checkpoint, the embedded
engine behind the real sglang-router, and the Megatron trainer.

- a multi-turn tool-calling generate (a tool server on 127.0.0.1) + an async reward + a custom data source:
  tool tokens are in the response with loss mask 0, the trainer's and the engine's log-probs agree over the
  trained tokens;
- a custom rollout function over upstream's generate_rollout + --group-rm batched reward + the dynamic
  sampling filter with fallback + a custom loss.
"""

from __future__ import annotations

import json
import math
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytestmark = pytest.mark.timeout(600)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Tool(BaseHTTPRequestHandler):
    calls = 0

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Tool.calls += 1
        reply = json.dumps({"text": f" answer is {len(str(body['query'])) % 10} ."}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import ray

    from slime.ray.placement_group import init_ray
    from glm5_helpers import write_run_inputs

    inputs = write_run_inputs(tmp_path_factory.mktemp("plugins"), 32, (3, 3), eval_prompts=2)
    d = inputs["dir"]
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Tool)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    saved = {k: os.environ.get(k) for k in ("SLIME_TOOL_URL", "SLIME_PLUGIN_LOG", "PYTHONPATH")}
    os.environ["SLIME_TOOL_URL"] = f"http://127.0.0.1:{server.server_address[1]}/tool"
    os.environ["SLIME_PLUGIN_LOG"] = str(d / "plugin_log.jsonl")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, saved["PYTHONPATH"]) if p)  # tests.* in Ray workers
    os.environ.setdefault("SLIME_CPU_THREADS", "1")
    init_ray(num_cpus=2)
    yield {**inputs, "log": d / "plugin_log.jsonl"}
    ray.shutdown()
    server.shutdown()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _run(env, name, *extra):
    from slime.config.arguments import parse_args
    from slime.train import train

    env["log"].write_text("")
    argv = ["--hf-checkpoint", env["model"], "--prompt-data", env["data"], "--apply-chat-template",
            "--input-key", "prompt", "--label-key", "label", "--rollout-batch-size", "2", "--n-samples-per-prompt",
            "4", "--rollout-max-response-len", "8", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "256",
            "--lr", "5e-3", "--num-cpus", "2", "--num-rollout", "3", "--colocate", "--update-weight-mode", "ipc",
            "--output-dir", str(env["dir"] / name), *extra]
    records = train(parse_args(argv))
    log = [json.loads(line) for line in env["log"].read_text().splitlines()]
    return records, log


def _check_records(records):
    assert len(records) == 3
    for r in records:
        assert math.isfinite(r["train/grad_norm"]) and math.isfinite(r["train/loss"])
        # trained tokens only: tool output (loss mask 0, placeholder log-prob 0.0) would show here otherwise
        assert r["train_rollout_logprob_abs_diff"] < 1e-3, r["train_rollout_logprob_abs_diff"]


def test_tool_calling_generate_async_reward_custom_data_source(env):
    _Tool.calls = 0
    records, log = _run(env, "tool", "--custom-generate-function-path", "tests.upstream_plugins.tool_calling_generate",
                        "--custom-rm-path", "tests.upstream_plugins.async_reward",
                        "--data-source-path", "tests.upstream_plugins.FileOrderDataSource",
                        "--eval-interval", "3", "--skip-eval-before-train", "--eval-prompt-data", "copy",
                        str(env["dir"] / "eval.jsonl"), "--n-samples-per-eval-prompt", "1",
                        "--custom-megatron-init-path", "tests.upstream_plugins.megatron_init",
                        "--custom-megatron-before-log-prob-hook-path", "tests.upstream_plugins.before_log_prob",
                        "--custom-megatron-before-train-step-hook-path", "tests.upstream_plugins.before_train_step",
                        "--use-tis", "--custom-tis-function-path", "tests.upstream_plugins.tis_function",
                        "--custom-pg-loss-reducer-function-path", "tests.upstream_plugins.dr_grpo_reducer",
                        "--rollout-data-postprocess-path", "tests.upstream_plugins.rollout_data_postprocess",
                        "--custom-rollout-log-function-path", "tests.upstream_plugins.rollout_log",
                        "--custom-eval-rollout-log-function-path", "tests.upstream_plugins.eval_rollout_log")
    _check_records(records)
    # upstream's loss, data and log hooks: each called where upstream calls it, on every rollout
    tis, reducers = [x for x in log if x["kind"] == "tis"], [x for x in log if x["kind"] == "reducer"]
    assert sum(x["samples"] for x in tis) == sum(x["samples"] for x in reducers) == 3 * 2 * 4
    assert all(x["ok"] and all(t > n for t, n in zip(x["total"], x["lengths"])) for x in tis)
    post = [x for x in log if x["kind"] == "postprocess"]
    assert [(x["rollout_id"], x["samples"]) for x in post] == [(0, 8), (1, 8), (2, 8)] and all(x["masks_ok"] for x in post)
    assert {"advantages", "loss_masks", "rollout_log_probs", "total_lengths"} <= set(post[0]["keys"])
    logs = [x for x in log if x["kind"] == "rollout_log"]
    assert [(x["rollout_id"], x["samples"]) for x in logs] == [(0, 8), (1, 8), (2, 8)]
    assert all(x["has_reward_mean"] and x["time"] > 0 for x in logs)
    assert [(x["rollout_id"], x["sets"], x["rewards"]) for x in log if x["kind"] == "eval_log"] == [(3, ["copy"], 2)]
    assert [x["lr"] for x in log if x["kind"] == "megatron_init"] == [5e-3]  # one trainer rank, once
    steps = [x for x in log if x["kind"] == "before_train_step"]
    assert [(x["rollout_id"], x["step_id"]) for x in steps] == [(0, 0), (1, 0), (2, 0)]
    assert all(x["has_model"] and x["has_scheduler"] and x["lr"] > 0 for x in steps)
    # old log-probs come from the train step's own forward here (one step per rollout): no separate pass
    assert [x for x in log if x["kind"] == "before_log_prob"] == []
    from slime.utils.metrics import read_metrics

    evals = read_metrics(str(env["dir"] / "tool"), kind="eval")  # upstream's eval path: evaluation=True
    assert [e["eval_step"] for e in evals] == [3] and evals[0]["eval/copy/samples"] == 2.0
    assert 0.0 <= evals[0]["eval/copy/reward_mean"] <= 1.0
    eval_gens = [x["index"] for x in log if x["kind"] == "generate" and x["evaluation"]]
    assert len(eval_gens) == 2
    gens = [x for x in log if x["kind"] == "generate" and not x["evaluation"]]
    assert len(gens) == 3 * 2 * 4 and _Tool.calls == len(gens) + 2  # every sample called the tool once
    for g in gens:
        first = g["response_length"] - g["tool_tokens"]
        assert g["tool_tokens"] > 0 and g["tokens"] == g["prompt_len"] + g["response_length"]
        mask = g["loss_mask"]
        assert len(mask) == g["response_length"] == g["log_probs"] and sum(mask) == first
        assert 0 in mask and mask[0] == 1 and mask[-1] == 1  # model, tool (0), model
    rewarded = sorted(x["index"] for x in log if x["kind"] == "reward")  # each sample once (eval ones too)
    assert rewarded == sorted([g["index"] for g in gens] + eval_gens)
    assert [x["first_group"] for x in log if x["kind"] == "get_samples"][:2] == [0, 2]  # file order, 2 a rollout


def test_custom_rollout_function_group_rm_dynamic_filter_custom_loss_text_generate(env):
    """Also --loss-type custom_loss: upstream's fn(args, batch, logits, sum_of_sample_mean) trains the model;
    its log-probs from get_log_probs_and_entropy equal the trainer's old log-probs (same weights). The generate
    function posts text as upstream's search-r1 example does (text_tool_calling_generate): the tiny word-level
    tokenizer re-splits the conversation's text differently from the ids the plugin assembles, and the engine
    must still condition each turn on those ids (slime/backends/embedded/text_continuations.py), or the
    trainer/engine log-probs of the second turn disagree (1e-2 and more)."""
    records, log = _run(env, "rollout", "--rollout-function-path", "tests.upstream_plugins.custom_rollout",
                        "--custom-generate-function-path", "tests.upstream_plugins.text_tool_calling_generate",
                        "--custom-rm-path", "tests.upstream_plugins.batched_reward", "--group-rm",
                        "--over-sampling-batch-size", "3", "--dynamic-sampling-filter-path",
                        "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std_with_fallback",
                        "--loss-type", "custom_loss", "--custom-loss-function-path", "tests.upstream_plugins.custom_pg_loss")
    _check_records(records)
    calls = [x for x in log if x["kind"] == "loss"]
    assert sum(c["samples"] for c in calls) == 3 * 2 * 4  # every trained sample of every rollout, once
    assert max(c["max_old_diff"] for c in calls) < 1e-4
    assert all(m <= n for c in calls for m, n in zip(c["masks"], c["lengths"]))
    assert all(r["train/grad_norm"] > 0 and r["train/entropy"] > 0 for r in records)
    rollouts = [x for x in log if x["kind"] == "rollout"]
    assert [x["rollout_id"] for x in rollouts] == [0, 1, 2]
    assert all(x["groups"] == 2 and x["sizes"] == [4, 4] for x in rollouts)
    assert [r["rollout/custom_fn_rollout_id"] for r in records] == [0.0, 1.0, 2.0]
    batches = [x["indices"] for x in log if x["kind"] == "batched_reward"]
    assert batches and all(len(b) == 4 for b in batches)  # one call per prompt group
    # the text path: every turn's engine input as long as the assembled ids, and the case re-tokenizes differently
    gens = [x for x in log if x["kind"] == "text_generate"]
    assert len(gens) >= 3 * 2 * 4 and any(g["retokenized_differs"] for g in gens)
    assert all(engine == assembled for g in gens for engine, assembled in g["engine_lengths"])
    assert all(0 in g["loss_mask"] and g["loss_mask"][0] == 1 for g in gens)
    assert all(r["train_rollout_logprob_abs_diff"] <= 1e-4 for r in records), \
        [r["train_rollout_logprob_abs_diff"] for r in records]

