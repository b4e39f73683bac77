"""An agent trajectory end to end on CPU: an agent client talks to slime.agent's OpenAI adapter, which serves it
from the embedded engine (tiny GLM-5 checkpoint); after each model turn the client runs a tool in a LocalSandbox
and sends its answer back as a tool message. The session's sample must hold exactly the turns' tokens, train the
model's tokens only (the tool's and the template's at loss mask 0, log-prob 0.0), and carry the engine's
log-probs, which equal transformers' teacher-forced ones on the whole token sequence."""

from __future__ import annotations

import asyncio

import pytest
import torch

from agent_plugins import agent_tokenizer, agent_turns
from slime.agent.adapters import AnthropicAdapter, OpenAIAdapter
from slime.agent.aiohttp_threaded import run_app_in_thread
from slime.agent.local_sandbox import isolation_problem
from slime.agent.sandbox import LocalSandbox
from slime.backends.embedded import EmbeddedEngine, EngineConfig, EngineHTTPServer
from slime.utils.types import Sample

pytestmark = pytest.mark.skipif(isolation_problem() is not None, reason=f"LocalSandbox: {isolation_problem()}")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from slime_plugins.models.glm5.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(str(tmp_path_factory.mktemp("agent") / "model"))
    server = EngineHTTPServer(EmbeddedEngine(EngineConfig(model_path=path)), "token-agent", 0)
    server.start_in_thread()
    yield path, server.url
    server.stop()


def _run_session(path, url, adapter_cls, reward=0.5):
    turns = []
    adapter = adapter_cls(tokenizer=agent_tokenizer(path), sglang_url=url,
                          debug_callback=lambda sid, msgs, tools, message, turn: turns.append(turn))
    handle = run_app_in_thread(adapter.app, host="127.0.0.1", port=0)

    async def go():
        adapter.open_session("sid-1", sampling_defaults={"max_new_tokens": 4, "temperature": 1.0})
        async with LocalSandbox() as sb:
            messages = await agent_turns(f"http://127.0.0.1:{handle.port}", "sid-1", "copy : a b c =", sb)
        samples = await adapter.finish_session("sid-1", base_sample=Sample(index=7, group_index=3, prompt="p"),
                                               reward=reward)
        return messages, samples
    try:
        return (*asyncio.run(go()), turns, adapter)
    finally:
        handle.stop()


def test_agent_trajectory_trains_model_tokens_only(engine):
    path, url = engine
    messages, samples, turns, adapter = _run_session(path, url, OpenAIAdapter)
    assert len(turns) == 3 and len(samples) == 1, (len(turns), [s.tokens for s in samples])
    s = samples[0]
    first = len(turns[0].prompt_ids)
    assert s.tokens == turns[-1].prompt_ids + turns[-1].output_ids  # every prompt extended the one before
    assert (s.index, s.group_index, s.rollout_id, s.reward, s.status) == (7, 3, 7, 0.5, Sample.Status.COMPLETED)
    assert s.response_length == len(s.tokens) - first == len(s.loss_mask) == len(s.rollout_log_probs)
    mask, logprobs = [0] * len(s.tokens), [0.0] * len(s.tokens)
    for t in turns:
        start = len(t.prompt_ids)
        assert s.tokens[start:start + len(t.output_ids)] == t.output_ids
        mask[start:start + len(t.output_ids)] = [1] * len(t.output_ids)
        logprobs[start:start + len(t.output_ids)] = t.output_log_probs
    assert s.loss_mask == mask[first:] and s.rollout_log_probs == logprobs[first:]
    assert sum(s.loss_mask) == sum(len(t.output_ids) for t in turns) > 0

    # the sandboxed tool's answers: the replies' word counts, in the context at loss mask 0
    tool_answers = [m["content"] for m in messages if m["role"] == "tool"]
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    assert tool_answers == [str(len(r.split())) for r in replies[:2]]
    tok = adapter.tokenizer
    for i, answer in enumerate(tool_answers):
        ids = tok.encode(f"<|user|> {answer}", add_special_tokens=False)
        lo, hi = len(turns[i].prompt_ids) + len(turns[i].output_ids), len(turns[i + 1].prompt_ids)
        window = s.tokens[lo:hi]
        at = next(j for j in range(len(window)) if window[j:j + len(ids)] == ids)
        assert all(mask[lo + at + k] == 0 and logprobs[lo + at + k] == 0.0 for k in range(len(ids)))
    assert s.response.endswith(tok.decode(turns[-1].output_ids, skip_special_tokens=False))

    # the engine's log-probs of the trained tokens = transformers' on the whole sequence (float32, 1e-4)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([s.tokens])).logits[0, :-1].double()
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.tokens[1:])[:, None])[:, 0]
    trained = [first + i for i, m in enumerate(s.loss_mask) if m]
    got = torch.tensor([s.rollout_log_probs[p - first] for p in trained], dtype=torch.float64)
    torch.testing.assert_close(got, ref[[p - 1 for p in trained]], atol=1e-4, rtol=0)


def test_anthropic_adapter_session_gives_the_same_shape(engine):
    """The Messages adapter through the same engine, driven with its own wire (session id in X-Api-Key, tool
    results as user blocks): one sample, at most 2 x 3 trained tokens, shapes consistent."""
    import aiohttp

    path, url = engine
    adapter = AnthropicAdapter(tokenizer=agent_tokenizer(path), sglang_url=url)
    handle = run_app_in_thread(adapter.app, host="127.0.0.1", port=0)

    async def go():
        adapter.open_session("a-1", sampling_defaults={"max_new_tokens": 3})
        msgs = [{"role": "user", "content": "copy : a ="}]
        async with aiohttp.ClientSession(trust_env=False) as http, LocalSandbox() as sb:
            for _ in range(2):
                async with http.post(f"http://127.0.0.1:{handle.port}/v1/messages", headers={"X-Api-Key": "a-1"},
                                     json={"model": "m", "max_tokens": 8, "system": "count", "messages": msgs}) as r:
                    body = await r.json()
                text = "".join(b.get("text", "") for b in body["content"])
                msgs.append({"role": "assistant", "content": body["content"]})
                code, out, _ = await sb.exec(f"echo {len(text.split())}")
                msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                          "content": out.strip()}]})
        return body, await adapter.finish_session("a-1", base_sample=Sample(index=1), reward=1.0)
    try:
        body, samples = asyncio.run(go())
    finally:
        handle.stop()
    assert body["type"] == "message" and body["stop_reason"] in ("end_turn", "max_tokens")
    assert len(samples) == 1 and 0 < sum(samples[0].loss_mask) <= 6 and samples[0].reward == 1.0
    assert len(samples[0].loss_mask) == samples[0].response_length == len(samples[0].rollout_log_probs)
