"""Anthropic Messages adapter (upstream slime's `slime.agent.adapters.anthropic` contract): `POST
/v1/messages` (plain or streamed) and `/v1/messages/count_tokens`, for Claude Code and other Messages
clients. The session id is the bearer token, else the X-Api-Key header. A session's sub-agents and
compactions need no tracking here: a history that diverges branches in the trajectory manager's tree."""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any

from aiohttp import web

from slime.agent.adapters.common import (BaseAdapter, Reply, flatten_content, manager_finish_reason, sid_from_bearer,
                                         tool_call_dict)
from slime.agent.parsing import ParsedModelOutput

logger = logging.getLogger(__name__)
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
REMINDER_OPEN, REMINDER_CLOSE = "<system-reminder>\n", "\n</system-reminder>\n"


class AnthropicAdapter(BaseAdapter):
    logger = logger
    log_prefix = "anthropic_adapter"
    max_token_keys = ("max_tokens",)
    stop_keys = ("stop_sequences",)

    def _register_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self._run_turn)
        app.router.add_post("/v1/messages/count_tokens", _count_tokens)

    def _session_id(self, request: web.Request, body: dict) -> str:
        return _request_session_id(request)

    def _preprocess_body(self, body: dict) -> None:
        _fold_mid_list_system_into_user(body)

    def _translate(self, body: dict) -> tuple[list[dict], list[dict] | None]:
        return _translate_messages(body.get("messages") or [], body.get("system")), _tools_to_chat_tools(body.get("tools"))

    def _build_reply(self, parsed, raw_finish, translated, tools_schema) -> Reply:
        blocks, stop_reason, manager_message = _build_reply_parts(parsed, raw_finish)
        return Reply(manager_message=manager_message, finish_reason=manager_finish_reason(parsed.tool_uses, raw_finish),
                     wire=(blocks, stop_reason))

    async def _respond(self, request, body, reply, in_tok, out_tok, stream) -> web.StreamResponse:
        blocks, stop_reason = reply.wire
        if stream:
            return await _render_stream(request, blocks, stop_reason, in_tok, out_tok)
        return web.json_response(_render_response(body, blocks, stop_reason, in_tok, out_tok))


def _as_blocks(content: Any) -> list:
    return content if isinstance(content, list) else [{"type": "text", "text": flatten_content(content)}]


def _user_messages(content: Any) -> list[dict]:
    """A user turn's blocks, one message each: tool results as "tool" messages, the rest as "user"."""
    out = []
    for block in _as_blocks(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            out.append({"role": "tool", "content": flatten_content(block.get("content"))})
        elif kind == "text":
            out.append({"role": "user", "content": block.get("text", "")})
        else:
            out.append({"role": "user", "content": flatten_content(block)})
    return out


def _assistant_message(content: Any) -> dict:
    texts, thinking, calls = [], [], []
    for block in _as_blocks(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(block.get("text", ""))
        elif kind == "thinking":
            thinking.append(block.get("thinking", ""))
        elif kind == "tool_use":
            calls.append(tool_call_dict(block.get("name", "tool"), block.get("input")))
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        out["reasoning_content"] = "".join(thinking)
    if calls:
        out["tool_calls"] = calls
    return out


def _translate_messages(msgs: list[dict], system: Any) -> list[dict]:
    """Messages (+ the top-level system) -> chat-template messages; tool_use ids dropped so a replayed
    reply equals the recorded one."""
    out = [{"role": "system", "content": flatten_content(system)}] if system else []
    for m in msgs:
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        if role == "user":
            out += _user_messages(m.get("content"))
        elif role == "assistant":
            out.append(_assistant_message(m.get("content")))
        elif role == "system":
            out.append({"role": "system", "content": flatten_content(m.get("content"))})
    return out


def _tools_to_chat_tools(anth_tools: list[dict] | None) -> list[dict] | None:
    schema = [{"type": "function",
               "function": {"name": t["name"], "description": t.get("description", ""),
                            "parameters": t.get("input_schema") or t.get("parameters") or EMPTY_PARAMETERS}}
              for t in anth_tools or [] if isinstance(t, dict) and "name" in t]
    return schema or None


def _build_reply_parts(parsed: ParsedModelOutput, finish: str) -> tuple[list[dict], str, dict[str, Any]]:
    """(content blocks, stop reason, recorded message)."""
    blocks: list[dict] = []
    if parsed.reasoning:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning})
    if parsed.text:
        blocks.append({"type": "text", "text": parsed.text})
    recorded: dict[str, Any] = {"role": "assistant", "content": parsed.text or ""}
    if parsed.reasoning:
        recorded["reasoning_content"] = parsed.reasoning
    for use in parsed.tool_uses:
        blocks.append({"type": "tool_use", "id": f"toolu_{secrets.token_hex(8)}", "name": use["name"],
                       "input": use["input"]})
        recorded.setdefault("tool_calls", []).append(tool_call_dict(use["name"], use.get("input")))
    if not blocks:
        blocks.append({"type": "text", "text": ""})
    stop = "tool_use" if parsed.tool_uses else ("max_tokens" if finish == "length" else "end_turn")
    return blocks, stop, recorded


def _request_session_id(request: web.Request) -> str:
    """The bearer token, else X-Api-Key (Messages bodies carry no session hint)."""
    return sid_from_bearer(request) or (request.headers.get("X-Api-Key") or "").strip() or "default"


def _render_response(body: dict, blocks: list[dict], stop_reason: str, in_tok: int, out_tok: int) -> dict:
    return {"id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "assistant",
            "model": body.get("model", "slime-actor"), "content": blocks, "stop_reason": stop_reason,
            "stop_sequence": None, "usage": {"input_tokens": in_tok, "output_tokens": out_tok}}


def _block_events(index: int, block: dict) -> list[tuple[str, dict]]:
    kind = block["type"]
    if kind == "thinking":
        start, delta = {"type": "thinking", "thinking": ""}, {"type": "thinking_delta", "thinking": block["thinking"]}
    elif kind == "text":
        start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
    else:
        start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
    return [("content_block_start", {"type": "content_block_start", "index": index, "content_block": start}),
            ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}),
            ("content_block_stop", {"type": "content_block_stop", "index": index})]


async def _render_stream(request, blocks, stop_reason, in_tok, out_tok) -> web.StreamResponse:
    """The finished turn as Messages SSE events: message_start, a start/delta/stop triple per block,
    message_delta (stop reason, usage), message_stop."""
    out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                  "Connection": "keep-alive"})
    await out.prepare(request)
    events = [("message_start", {"type": "message_start", "message": {
        "id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "assistant", "model": "slime-actor",
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": in_tok, "output_tokens": 0}}})]
    for i, block in enumerate(blocks):
        events += _block_events(i, block)
    events += [("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                                  "usage": {"input_tokens": in_tok, "output_tokens": out_tok}}),
               ("message_stop", {"type": "message_stop"})]
    for name, data in events:
        await out.write(f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode())
    return out


async def _count_tokens(request: web.Request) -> web.Response:
    """Clients read it as a hint only; 0 (as upstream's)."""
    await request.read()
    return web.json_response({"input_tokens": 0})


def _fold_mid_list_system_into_user(body_obj: dict) -> bool:
    """System messages after the first position (many templates refuse them) move into the closest earlier
    user message, else the next one, as a <system-reminder> text block; with no user message at all the
    system message becomes a user message. In place; True when anything moved."""
    msgs = body_obj.get("messages")
    if not isinstance(msgs, list):
        return False
    late = [i for i, m in enumerate(msgs) if i > 0 and isinstance(m, dict) and m.get("role") == "system"]
    if not late:
        return False
    folded = set()
    for i in late:
        block = {"type": "text", "text": REMINDER_OPEN + flatten_content(msgs[i].get("content")) + REMINDER_CLOSE}
        before = [j for j in range(i - 1, -1, -1) if isinstance(msgs[j], dict) and msgs[j].get("role") == "user"]
        after = [j for j in range(i + 1, len(msgs)) if isinstance(msgs[j], dict) and msgs[j].get("role") == "user"]
        if before:
            _content_blocks(msgs[before[0]]).append(block)
        elif after:
            _content_blocks(msgs[after[0]]).insert(0, block)
        else:
            msgs[i] = {"role": "user", "content": [block]}
            continue
        folded.add(i)
    body_obj["messages"] = [m for i, m in enumerate(msgs) if i not in folded]
    return True


def _content_blocks(msg: dict) -> list:
    if not isinstance(msg.get("content"), list):
        msg["content"] = [{"type": "text", "text": msg.get("content") if isinstance(msg.get("content"), str) else ""}]
    return msg["content"]
