"""An agent rollout as upstream's coding-agent example runs one, on CPU: the OpenAI adapter in front of the
rollout engine, an agent client talking to it over HTTP (standing in for a CLI such as Codex), and a tool run
in a LocalSandbox after every model turn. The tool counts the words of the model's reply (`wc -w`, no
network), and its answer goes back as a "tool" message, so the trajectory alternates model tokens (trained)
and tool tokens (context).

`generate` is a --custom-generate-function-path for train.py (tests/test_agent_run.py); `agent_turns` is the
client loop (tests/test_agent_rollout.py drives it against an embedded engine directly)."""

from __future__ import annotations

import uuid

import aiohttp

from slime.agent.adapters import OpenAIAdapter
from slime.agent.aiohttp_threaded import run_app_in_thread
from slime.agent.sandbox import LocalSandbox
from slime.utils.misc import SingletonMeta
from slime.utils.processing_utils import load_tokenizer
from slime.utils.types import Sample

# The tiny tokenizer's own template renders user and assistant turns only; an agent's needs system and tool
# messages (and tool calls) too. Tool output goes in as a user-marked turn.
AGENT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|> {{ m['content'] }} "
    "{% for c in m.get('tool_calls') or [] %}( {{ c['function']['name'] }} ) {% endfor %}"
    "{% else %}<|user|> {{ m['content'] }} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "count", "description": "count the words of a text",
                                           "parameters": {"type": "object", "properties": {}}}}]
AGENT_TURNS = 3


def agent_tokenizer(path: str):
    tokenizer = load_tokenizer(path)
    tokenizer.chat_template = AGENT_TEMPLATE
    return tokenizer


async def run_tool(sb: LocalSandbox, text: str) -> str:
    await sb.write_file("reply.txt", text)
    code, out, err = await sb.exec("wc -w < reply.txt", timeout=30)
    if code != 0:
        raise RuntimeError(f"tool failed ({code}): {err}")
    return out.strip()


async def agent_turns(adapter_url: str, sid: str, task: str, sb: LocalSandbox, turns: int = AGENT_TURNS) -> list[dict]:
    """The client's side: `turns` model turns, the tool after each but the last; the final message list."""
    messages = [{"role": "system", "content": "count"}, {"role": "user", "content": task}]
    async with aiohttp.ClientSession(trust_env=False) as http:
        for turn in range(turns):
            async with http.post(f"{adapter_url}/v1/chat/completions", headers={"Authorization": f"Bearer {sid}"},
                                 json={"model": "m", "messages": messages, "tools": TOOLS}) as r:
                r.raise_for_status()
                reply = (await r.json())["choices"][0]["message"]
            messages.append({"role": "assistant", "content": reply["content"] or ""})
            if turn + 1 < turns:
                messages.append({"role": "tool", "tool_call_id": f"call_{turn}",
                                 "content": await run_tool(sb, reply["content"] or "")})
    return messages


class AgentService(metaclass=SingletonMeta):
    """One adapter per rollout process, served from its own thread, in front of the run's router."""

    def __init__(self, args) -> None:
        url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}"
        self.adapter = OpenAIAdapter(tokenizer=agent_tokenizer(args.hf_checkpoint), sglang_url=url)
        self.handle = run_app_in_thread(self.adapter.app, host="127.0.0.1", port=0, thread_name="agent-adapter")
        self.url = f"http://127.0.0.1:{self.handle.port}"


async def generate(args, sample: Sample, sampling_params: dict, evaluation: bool = False) -> list[Sample]:
    service = AgentService(args)
    sid = f"agent-{sample.index}-{uuid.uuid4().hex[:8]}"
    service.adapter.open_session(sid, sampling_defaults=sampling_params)
    try:
        async with LocalSandbox() as sb:
            messages = await agent_turns(service.url, sid, sample.prompt, sb)
        counts = [m["content"] for m in messages if m["role"] == "tool"]
        reward = float(len(messages[-1]["content"]) % 2)  # one the untrained model's replies differ on
        samples = await service.adapter.finish_session(sid, base_sample=sample, reward=reward,
                                                       extra_metadata={"tool_outputs": counts})
    finally:
        await service.adapter.drop_session(sid)
    return samples


def dump_train_data(args, rollout_id, rollout_data) -> None:
    """--rollout-data-postprocess-path: what the trainer trains on, one JSON line per sample, to
    $AGENT_TRAIN_DUMP."""
    import json
    import os

    with open(os.environ["AGENT_TRAIN_DUMP"], "a") as f:
        for tokens, n, mask, reward in zip(rollout_data["tokens"], rollout_data["response_lengths"],
                                           rollout_data["loss_masks"], rollout_data["rewards"]):
            f.write(json.dumps({"rollout_id": rollout_id, "tokens": [int(t) for t in tokens],
                                "response_length": int(n), "loss_mask": [int(m) for m in mask],
                                "reward": float(reward)}) + "\n")
