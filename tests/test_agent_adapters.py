"""slime.agent's adapters over HTTP against a scripted engine (`/generate` answering fixed token ids and
log-probs): the request the engine gets (input ids, sampling params, the session's routing key), the wire
replies (plain and streamed, OpenAI and Anthropic), the turn cap (429), a finished session (503), the context
budget, an engine error, and the samples a session gives."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from slime.agent.adapters import AnthropicAdapter, OpenAIAdapter
from slime.agent.adapters import anthropic as anth
from slime.agent.adapters import openai as oai
from slime.agent.aiohttp_threaded import run_app_in_thread
from slime.utils.types import Sample


class ScriptedTokenizer:
    """Each render pops the next scripted prompt; decode maps output ids to scripted text."""

    def __init__(self, prompts, outputs):
        self.prompts, self.outputs, self.rendered = [list(p) for p in prompts], outputs, []

    def apply_chat_template(self, messages, tools=None, tokenize=True, add_generation_prompt=True):
        self.rendered.append((messages, tools))
        return self.prompts.pop(0)

    def decode(self, ids, skip_special_tokens=False):
        return self.outputs.get(tuple(ids), " ".join(map(str, ids)))


class ScriptedEngine:
    def __init__(self, turns, finish="stop", status=200):
        self.turns, self.finish, self.status = list(turns), finish, status
        self.requests, self.keys, self.aborts = [], [], []
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort_request", self.abort)
        self.handle = run_app_in_thread(app, host="127.0.0.1", port=0)
        self.url = f"http://127.0.0.1:{self.handle.port}"

    async def generate(self, request):
        self.keys.append(request.headers.get("X-SMG-Routing-Key"))
        self.requests.append(await request.json())
        if self.status != 200:
            return web.json_response({"error": {"message": "bad"}}, status=self.status)
        pairs = self.turns.pop(0)
        return web.json_response({"text": "", "meta_info": {"output_token_logprobs": [[lp, t] for lp, t in pairs],
                                                            "finish_reason": {"type": self.finish}}})

    async def abort(self, request):
        self.aborts.append(await request.json())
        return web.json_response({"success": True})


@pytest.fixture
def serve():
    handles = []

    def start(adapter_cls, engine, tokenizer, **kw):
        adapter = adapter_cls(tokenizer=tokenizer, sglang_url=engine.url + "/", **kw)
        handles.extend([engine.handle, run_app_in_thread(adapter.app, host="127.0.0.1", port=0)])
        return adapter, f"http://127.0.0.1:{handles[-1].port}"
    yield start
    for h in handles:
        h.stop()


async def _post(url, body, headers):
    async with aiohttp.ClientSession(trust_env=False) as http, http.post(url, json=body, headers=headers) as r:
        return r.status, r.headers.get("Content-Type", ""), await r.text()


def test_openai_turns_record_a_session(serve):
    engine = ScriptedEngine([[(-0.1, 201), (-0.2, 202)], [(-0.3, 203)]])
    tok = ScriptedTokenizer([[1, 2], [1, 2, 201, 202, 9, 10]], {(201, 202): "hello there", (203,): "bye"})
    adapter, url = serve(OpenAIAdapter, engine, tok)
    adapter.open_session("s1", sampling_defaults={"max_new_tokens": 16, "temperature": 0.7})

    async def go():
        first = await _post(f"{url}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 5}, {"Authorization": "Bearer s1"})
        second = await _post(f"{url}/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
                         {"role": "tool", "tool_call_id": "x", "content": "42"}], "stream": True},
            {"Authorization": "Bearer s1"})
        samples = await adapter.finish_session("s1", base_sample=Sample(index=4), reward=2.0)
        late = await _post(f"{url}/v1/chat/completions", {"messages": []}, {"Authorization": "Bearer s1"})
        return first, second, samples, late
    first, second, samples, late = asyncio.run(go())
    body = json.loads(first[2])
    assert body["object"] == "chat.completion" and body["choices"][0]["message"] == {"role": "assistant",
                                                                                     "content": "hello there"}
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    params = engine.requests[0]["sampling_params"]
    assert engine.requests[0]["input_ids"] == [1, 2] and engine.requests[0]["return_logprob"] is True
    assert (params["max_new_tokens"], params["temperature"], params["no_stop_trim"]) == (5, 0.7, True)
    assert engine.requests[1]["sampling_params"]["max_new_tokens"] == 16 and engine.keys == ["s1", "s1"]
    assert second[1].startswith("text/event-stream")
    events = [line[6:] for line in second[2].split("\n") if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert chunks[1]["choices"][0]["delta"] == {"content": "bye"} and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert len(samples) == 1
    s = samples[0]
    assert s.tokens == [1, 2, 201, 202, 9, 10, 203] and s.response_length == 5 and s.reward == 2.0
    assert s.loss_mask == [1, 1, 0, 0, 1] and s.rollout_log_probs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert s.response == "201 202 9 10 203" and late[0] == 503  # decoded from the response tokens


def test_anthropic_stream_tool_use_and_turn_cap(serve):
    engine = ScriptedEngine([[(-0.5, 301)]])
    text = "<tool_call><function=lookup><parameter=q>slime</parameter></function></tool_call>"
    tok = ScriptedTokenizer([[7, 8]], {(301,): text})
    adapter, url = serve(AnthropicAdapter, engine, tok, max_turns_per_sid=1)
    tools = [{"name": "lookup", "input_schema": {"type": "object"}}]

    async def go():
        first = await _post(f"{url}/v1/messages", {"messages": [{"role": "user", "content": "q"}], "tools": tools,
                                                   "stream": True, "stop_sequences": ["END"]}, {"X-Api-Key": "k"})
        second = await _post(f"{url}/v1/messages", {"messages": [{"role": "user", "content": "q"}]},
                             {"X-Api-Key": "k"})
        counted = await _post(f"{url}/v1/messages/count_tokens", {"messages": []}, {})
        return first, second, counted, await adapter.finish_session("k", base_sample=Sample(index=0))
    first, second, counted, samples = asyncio.run(go())
    assert tok.rendered[0][1] == [{"type": "function", "function": {"name": "lookup", "description": "",
                                                                    "parameters": {"type": "object"}}}]
    assert engine.requests[0]["sampling_params"]["stop"] == ["END"]
    names = [line[7:] for line in first[2].split("\n") if line.startswith("event: ")]
    datas = [json.loads(line[6:]) for line in first[2].split("\n") if line.startswith("data: ")]
    assert names == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    assert datas[1]["content_block"]["name"] == "lookup"
    assert json.loads(datas[2]["delta"]["partial_json"]) == {"q": "slime"}
    assert datas[4]["delta"]["stop_reason"] == "tool_use"
    assert second[0] == 429 and "max_turns_per_sid=1" in second[2] and json.loads(counted[2]) == {"input_tokens": 0}
    assert len(samples) == 1 and samples[0].metadata["use_tool"] is True and samples[0].loss_mask == [1]


def test_context_budget_and_engine_errors(serve):
    engine = ScriptedEngine([], status=500)
    tok = ScriptedTokenizer([[1, 2, 3], [1, 2]], {})
    adapter, url = serve(OpenAIAdapter, engine, tok)
    adapter.open_session("full", max_context_tokens=3)

    async def go():
        full = await _post(f"{url}/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]},
                           {"Authorization": "Bearer full"})
        broken = await _post(f"{url}/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                            "user": "u"}, {})
        return full, broken, await adapter.finish_session("full", base_sample=Sample())
    full, broken, samples = asyncio.run(go())
    assert json.loads(full[2])["choices"][0]["finish_reason"] == "length"  # no room left: no engine call
    assert len(engine.requests) == 1 and engine.keys == ["u"] and broken[0] == 500
    assert samples == []  # nothing trained
    with pytest.raises(ValueError, match="already exists"):
        adapter.open_session("x") or adapter.open_session("x")


def test_session_ids_from_headers_and_body():
    class Req:
        def __init__(self, headers):
            self.headers = headers
    assert anth._request_session_id(Req({"Authorization": "Bearer b", "X-Api-Key": "k"})) == "b"
    assert anth._request_session_id(Req({"X-Api-Key": " k "})) == "k"
    assert anth._request_session_id(Req({})) == "default"
    assert oai._request_session_id(Req({}), {"metadata": {"session_id": "m"}, "user": "u"}) == "m"
    assert oai._request_session_id(Req({"Authorization": "bearer  z "}), {"user": "u"}) == "z"
    assert oai._request_session_id(Req({}), {}) == "default"
