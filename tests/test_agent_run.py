"""An agent rollout driving train.py for 3 iterations on CPU (tiny GLM-5 quick-start checkpoint, embedded engine
behind the router, Ray, colocated trainer): tests/agent_plugins.generate runs each sample as an agent session
through slime.agent's OpenAI adapter, with a sandboxed tool (LocalSandbox) between model turns, and returns the
session's samples. What the trainer trains on (dumped by --rollout-data-postprocess-path) must have the tool's
and the template's tokens at loss mask 0, and the trainer's log-probs must equal the engine's."""

from __future__ import annotations

import json
import math

import pytest

from logged_run import run_failure, run_train
from slime.agent.local_sandbox import isolation_problem
from slime.utils.metrics import read_metrics

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(isolation_problem() is not None, reason=f"LocalSandbox: {isolation_problem()}")]


def test_agent_rollout_trains_three_iterations(tmp_path):
    from glm5_helpers import write_run_inputs

    from agent_plugins import AGENT_TURNS, agent_tokenizer

    inputs = write_run_inputs(tmp_path, 8, (2, 3))
    out, dump = tmp_path / "run", tmp_path / "train_data.jsonl"
    argv = ["--hf-checkpoint", inputs["model"], "--prompt-data", inputs["data"],
            "--custom-generate-function-path", "agent_plugins.generate",
            "--rollout-data-postprocess-path", "agent_plugins.dump_train_data",
            "--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "3",
            "--use-dynamic-batch-size", "--max-tokens-per-gpu", "256", "--lr", "5e-3", "--num-rollout", "3",
            "--colocate", "--num-cpus", "2", "--output-dir", str(out)]
    proc = run_train(argv, timeout=280, AGENT_TRAIN_DUMP=str(dump))  # fails the test on a non-zero exit

    records = read_metrics(str(out))
    assert [r["rollout_id"] for r in records] == [0, 1, 2], run_failure(proc)
    for r in records:
        assert r["rollout/samples"] == 2 and math.isfinite(r["train/loss"]), r
        # over the trained (model) tokens; measured 1.3-2.1e-7 (the built-in path's order)
        assert r["train_rollout_logprob_abs_diff"] < 1e-5, r
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    assert sorted({r["rollout_id"] for r in rows}) == [0, 1, 2] and len(rows) == 6
    assert {r["reward"] for r in rows} <= {0.0, 1.0}  # the generate function's rewards reached the trainer
    tok = agent_tokenizer(inputs["model"])
    user, assistant = tok.convert_tokens_to_ids(["<|user|>", "<|assistant|>"])
    for row in rows:
        response = row["tokens"][-row["response_length"]:]
        mask = row["loss_mask"]
        assert len(mask) == len(response)
        tool_turns = [i for i, t in enumerate(response) if t == user]
        assert len(tool_turns) == AGENT_TURNS - 1, tok.convert_ids_to_tokens(response)
        for i in tool_turns:  # "<|user|> N <|assistant|>": the tool's answer and the template, never trained
            answer_end = response.index(assistant, i)
            assert answer_end > i + 1 and not any(mask[i:answer_end + 1]), (tok.convert_ids_to_tokens(response), mask)
            assert tok.decode(response[i + 1:answer_end]).strip().isdigit()
        assert sum(mask) == len(response) - 3 * len(tool_turns) and sum(mask) >= AGENT_TURNS
