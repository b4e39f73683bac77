"""OpenAI Chat Completions adapter (upstream slime's `slime.agent.adapters.openai` contract): `POST
/v1/chat/completions`, plain or streamed (SSE), for OpenAI-compatible agent CLIs such as Codex. The session
id is the request's bearer token (the CLI's API key), else the body's metadata.session_id or user.
The Responses API (/v1/responses) is not served (upstream's neither)."""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Any

from aiohttp import web

from slime.agent.adapters.common import (BaseAdapter, Reply, flatten_content, manager_finish_reason, sid_from_bearer,
                                         sid_from_body)
from slime.agent.parsing import ParsedModelOutput

logger = logging.getLogger(__name__)
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class OpenAIAdapter(BaseAdapter):
    logger = logger
    log_prefix = "openai_adapter"
    max_token_keys = ("max_completion_tokens", "max_tokens", "max_output_tokens")
    stop_keys = ("stop",)

    def _register_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._run_turn)

    def _session_id(self, request: web.Request, body: dict) -> str:
        return _request_session_id(request, body)

    def _translate(self, body: dict) -> tuple[list[dict], list[dict] | None]:
        messages = body.get("messages") or []
        if not isinstance(messages, list):
            raise web.HTTPBadRequest(text="messages must be a list")
        return _translate_messages(messages), _tools_to_chat_tools(body.get("tools"))

    def _build_reply(self, parsed, raw_finish, translated, tools_schema) -> Reply:
        wire_message, manager_message, wire_finish = _build_reply_parts(parsed, raw_finish)
        return Reply(manager_message=manager_message, finish_reason=manager_finish_reason(parsed.tool_uses, raw_finish),
                     wire=(wire_message, wire_finish))

    async def _respond(self, request, body, reply, in_tok, out_tok, stream) -> web.StreamResponse:
        wire_message, wire_finish = reply.wire
        if stream:
            return await _render_stream(request, body, wire_message, wire_finish, in_tok, out_tok)
        return web.json_response(_render_response(body, wire_message, wire_finish, in_tok, out_tok))


def _arguments_as_dict(arguments: Any) -> dict[str, Any]:
    """A call's arguments (OpenAI sends a JSON string) as a mapping; what is not a JSON object is kept
    as {"_raw_arguments": text}."""
    if isinstance(arguments, dict):
        return arguments
    if arguments is None:
        return {}
    if not isinstance(arguments, str):
        return {"_raw_arguments": str(arguments)}
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {"_raw_arguments": arguments}
    return value if isinstance(value, dict) else {"_raw_arguments": arguments}


def _assistant_message(msg: dict) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": flatten_content(msg.get("content"))}
    if msg.get("reasoning_content"):
        out["reasoning_content"] = msg["reasoning_content"]
    calls = []
    for call in msg.get("tool_calls") or []:
        if not isinstance(call, dict):
            continue
        fn = call.get("function") or {}
        arguments = fn.get("arguments")
        if arguments is None:
            arguments = call.get("arguments", {})
        calls.append({"type": "function", "function": {"name": fn.get("name") or call.get("name") or "tool",
                                                       "arguments": _arguments_as_dict(arguments)}})
    if calls:
        out["tool_calls"] = calls
    return out


def _translate_messages(messages: list[dict]) -> list[dict]:
    """Wire messages -> chat-template messages that compare equal to the recorded turns when replayed:
    arguments as mappings, wire ids (tool_call_id, tool_calls[].id) dropped, "developer" read as "system",
    unknown roles dropped."""
    out: list[dict] = []
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        role = "system" if msg.get("role") == "developer" else msg.get("role")
        if role in ("system", "user", "tool"):
            out.append({"role": role, "content": flatten_content(msg.get("content"))})
        elif role == "assistant":
            out.append(_assistant_message(msg))
    return out


def _tools_to_chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Function tools (nested {"function": {...}} or flat) as the template's schema; others dropped."""
    schema = []
    for tool in tools or []:
        if not isinstance(tool, dict) or (tool.get("type") and tool.get("type") != "function"):
            continue
        spec = tool["function"] if isinstance(tool.get("function"), dict) else tool
        if not spec.get("name"):
            continue
        schema.append({"type": "function", "function": {"name": spec["name"],
                                                        "description": spec.get("description", ""),
                                                        "parameters": spec.get("parameters") or EMPTY_PARAMETERS}})
    return schema or None


def _build_reply_parts(parsed: ParsedModelOutput, finish: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(wire message, recorded message, wire finish reason). The wire carries fresh call ids, JSON-string
    arguments and content null beside tool calls; the recorded message is what the client will echo back:
    no reasoning (clients drop it), only the first call (clients drop parallel ones), "" beside a call."""
    calls = []
    for use in parsed.tool_uses:
        arguments = use.get("input") or {}
        if not isinstance(arguments, dict):
            arguments = {"_raw_arguments": str(arguments)}
        calls.append((use.get("name", "tool"), arguments))
    wire: dict[str, Any] = {"role": "assistant", "content": None if calls else (parsed.text or None)}
    recorded: dict[str, Any] = {"role": "assistant", "content": "" if calls else (parsed.text or "")}
    if parsed.reasoning:
        wire["reasoning_content"] = parsed.reasoning
    if calls:
        name, arguments = calls[0]
        wire["tool_calls"] = [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
                               "function": {"name": name,
                                            "arguments": json.dumps(arguments, ensure_ascii=False, sort_keys=True)}}]
        recorded["tool_calls"] = [{"type": "function", "function": {"name": name, "arguments": arguments}}]
    wire_finish = "tool_calls" if parsed.tool_uses else ("length" if finish == "length" else "stop")
    return wire, recorded, wire_finish


def _request_session_id(request: web.Request, body: dict) -> str:
    """The bearer token (where OpenAI clients put their API key), else metadata.session_id / user."""
    return sid_from_bearer(request) or sid_from_body(body) or "default"


def _usage(in_tok: int, out_tok: int) -> dict[str, int]:
    return {"prompt_tokens": in_tok, "completion_tokens": out_tok, "total_tokens": in_tok + out_tok}


def _render_response(body: dict, wire_message: dict[str, Any], wire_finish: str, in_tok: int,
                     out_tok: int) -> dict[str, Any]:
    return {"id": f"chatcmpl_{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model", "slime-actor"),
            "choices": [{"index": 0, "message": wire_message, "finish_reason": wire_finish}],
            "usage": _usage(in_tok, out_tok)}


async def _render_stream(request: web.Request, body: dict, wire_message: dict[str, Any], wire_finish: str,
                         in_tok: int, out_tok: int) -> web.StreamResponse:
    """The finished turn as SSE chunks: the role, then reasoning, content and all tool calls in one chunk
    each (clients that merge argument fragments per index would garble split parallel calls), then the
    finish reason with usage, then [DONE]."""
    out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                  "Connection": "keep-alive"})
    await out.prepare(request)
    head = {"id": f"chatcmpl_{secrets.token_hex(12)}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": body.get("model", "slime-actor")}

    async def chunk(delta: dict, finish_reason: str | None = None, usage: dict | None = None) -> None:
        data = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
        if usage is not None:
            data["usage"] = usage
        await out.write(f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode())

    await chunk({"role": "assistant"})
    if wire_message.get("reasoning_content"):
        await chunk({"reasoning_content": wire_message["reasoning_content"]})
    if wire_message.get("content"):
        await chunk({"content": wire_message["content"]})
    if wire_message.get("tool_calls"):
        await chunk({"tool_calls": [{**c, "index": i} for i, c in enumerate(wire_message["tool_calls"])]})
    await chunk({}, finish_reason=wire_finish, usage=_usage(in_tok, out_tok))
    await out.write(b"data: [DONE]\n\n")
    return out
