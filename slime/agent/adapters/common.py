"""What the Anthropic and OpenAI adapters share (upstream slime's `slime.agent.adapters.common` contract).

An adapter is an aiohttp application a coding agent's CLI talks to as if it were the provider's API. Each
request is one model turn: the wire messages become chat-template messages (`_translate`), the served
tokenizer renders them to token ids, the rollout engine's `/generate` answers with output ids and log-probs
(through this project's engine client, the one the trainer's weight sync and the rollout use), the decoded
text is parsed into reasoning / text / tool calls, the reply goes back in the wire format (`_respond`) and
the turn is recorded in the adapter's `TrajectoryManager` under the session id the client sent (its API
key). `finish_session(sid, base_sample=...)` then gives the session's training samples.

A subclass supplies `_register_routes`, `_session_id`, `_translate`, `_build_reply`, `_respond` (and may
override `_preprocess_body`) and the class attributes `logger`, `log_prefix`, `max_token_keys`, `stop_keys`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from slime.agent.parsing import parse_model_output, require_parsers
from slime.agent.trajectory import TrajectoryManager, TurnRecord
from slime.utils.http_client import EngineClient, EngineError

__all__ = ["TurnRecord"]

GENERATE_TIMEOUT_S = 900.0  # a long agent turn; upstream's read timeout
DEFAULT_MAX_NEW_TOKENS = 4096


@dataclasses.dataclass
class Session:
    """A session's sampling defaults and context budget (its turns live in the adapter's manager)."""

    sampling_defaults: dict = dataclasses.field(default_factory=dict)
    max_context_tokens: int = 0


@dataclasses.dataclass
class Reply:
    """`_build_reply`'s answer: the message recorded for the turn, its finish reason, and what `_respond`
    sends (opaque to the shared pipeline)."""

    manager_message: dict
    finish_reason: str
    wire: Any


def _render_token_ids(messages: list[dict], tokenizer, *, tools: list[dict] | None,
                      add_generation_prompt: bool = True) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                                        add_generation_prompt=add_generation_prompt)
    if hasattr(out, "__getitem__") and not isinstance(out, list) and "input_ids" in out:
        out = out["input_ids"]  # transformers 5 answers a BatchEncoding
    return list(out)


_TEXT_BLOCKS = {"text", "input_text", "output_text"}
_IMAGE_BLOCKS = {"image", "image_url", "input_image"}


def _block_text(block: Any) -> str:
    if isinstance(block, str):
        return block
    if not isinstance(block, dict):
        return str(block)
    kind = block.get("type")
    if kind in _TEXT_BLOCKS:
        return block.get("text", "")
    if kind == "tool_result":
        return flatten_content(block.get("content"))
    if kind in _IMAGE_BLOCKS:
        return "[image omitted]"
    if "content" in block:
        return flatten_content(block.get("content"))
    if "text" in block:
        return str(block.get("text") or "")
    return ""


def flatten_content(c: Any) -> str:
    """A wire content value (a string, or Anthropic / OpenAI blocks) as the text a chat template takes:
    blocks' texts joined by newlines, empty ones dropped, images as "[image omitted]"."""
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if not isinstance(c, list):
        return str(c)
    return "\n".join(t for t in map(_block_text, c) if t)


def tool_call_dict(name: str, arguments: dict | None) -> dict:
    """A tool call as recorded: arguments a mapping (templates need one, and history is matched by dict
    equality, which ignores key order) and no wire id (fresh on every reply, so it would never match)."""
    return {"type": "function", "function": {"name": name, "arguments": arguments or {}}}


def manager_finish_reason(tool_uses: list[dict], raw_finish: str) -> str:
    return "tool_calls" if tool_uses else (raw_finish or "stop")


def sid_from_bearer(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return None


def sid_from_body(body: dict | None) -> str | None:
    """metadata.session_id, else user, of an OpenAI body."""
    if not body:
        return None
    meta = body.get("metadata")
    if isinstance(meta, dict) and meta.get("session_id"):
        return str(meta["session_id"])
    return str(body["user"]) if body.get("user") else None


def _sampling_params(session: Any, body: dict, *, max_token_keys: tuple[str, ...],
                     stop_keys: tuple[str, ...]) -> dict:
    """The engine's sampling params: the raw text kept (special tokens, stop strings), the session's
    defaults, the request's own limit (never above the session's), temperature / top_p / top_k and stops."""
    params: dict[str, Any] = {"skip_special_tokens": False, "spaces_between_special_tokens": False,
                              "no_stop_trim": True, "max_new_tokens": DEFAULT_MAX_NEW_TOKENS,
                              **(session.sampling_defaults or {})}
    limit_key = next((k for k in max_token_keys if body.get(k) is not None), None)
    if limit_key is not None:
        asked = int(body[limit_key])
        params["max_new_tokens"] = min(int(params.get("max_new_tokens", asked)), asked)
    for key in ("temperature", "top_p", "top_k"):
        if key in body:
            params[key] = body[key]
    stop_key = next((k for k in stop_keys if body.get(k)), None)
    if stop_key is not None:
        params["stop"] = body[stop_key]
    return params


def _engine_client(adapter: BaseAdapter) -> EngineClient:
    client = getattr(adapter, "_engine_client", None)
    if client is None or client.url != adapter.sglang_url:
        client = adapter._engine_client = EngineClient(adapter.sglang_url, timeout=GENERATE_TIMEOUT_S)
    return client


async def _abort(client: EngineClient, rid: str) -> None:
    """Frees the engine's slot of a turn the client gave up on (best effort, as upstream's)."""
    try:
        await asyncio.wait_for(asyncio.to_thread(client.send, "POST", "/abort_request",
                                                 json.dumps({"rid": rid}).encode(),
                                                 {"Content-Type": "application/json"}, 5.0), 6.0)
    except Exception:  # noqa: BLE001 - the turn is already lost; its slot ends at its length cap anyway
        pass


async def call_sglang_generate(prompt_ids: list[int], session: Any, body: dict, *, adapter: BaseAdapter,
                               session_id: str | None = None) -> TurnRecord:
    """One turn through the engine's `/generate` (input ids, log-probs on) as a TurnRecord; a prompt already
    at the session's context budget gives an empty turn with finish reason "length"."""
    params = _sampling_params(session, body, max_token_keys=adapter.max_token_keys, stop_keys=adapter.stop_keys)
    if session.max_context_tokens > 0:
        room = session.max_context_tokens - len(prompt_ids)
        if room <= 0:
            adapter.logger.warning("[%s] sid=%s prompt exceeds max_context_tokens (%d >= %d)", adapter.log_prefix,
                                   session_id, len(prompt_ids), session.max_context_tokens)
            return TurnRecord(prompt_ids=list(prompt_ids), output_ids=[], finish_reason="length")
        params["max_new_tokens"] = min(int(params.get("max_new_tokens", room)), room)
    rid = uuid.uuid4().hex
    headers = {"Content-Type": "application/json"}
    if session_id and session_id != "default":
        headers["X-SMG-Routing-Key"] = session_id  # the router keeps a session on one engine
    payload = json.dumps({"rid": rid, "input_ids": list(prompt_ids), "sampling_params": params,
                          "return_logprob": True}).encode()
    client = _engine_client(adapter)
    try:
        status, raw = await asyncio.to_thread(client.send, "POST", "/generate", payload, headers)
    except (asyncio.CancelledError, EngineError, asyncio.TimeoutError):
        await _abort(client, rid)
        raise
    if status >= 400:
        text = raw.decode(errors="replace")
        adapter.logger.warning("[%s] sid=%s rid=%s engine answered %d: %.200s", adapter.log_prefix, session_id,
                               rid, status, text)
        raise RuntimeError(f"sglang upstream {status}: {text[:400]}")
    meta = (json.loads(raw) or {}).get("meta_info") or {}
    pairs = meta.get("output_token_logprobs") or []
    return TurnRecord(prompt_ids=list(prompt_ids), output_ids=[p[1] for p in pairs],
                      finish_reason=(meta.get("finish_reason") or {}).get("type", "stop") or "stop",
                      output_log_probs=[float(p[0]) for p in pairs])


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})



class BaseAdapter:
    """Session bookkeeping and the one-turn pipeline shared by the protocol adapters (module doc)."""

    logger: logging.Logger = logging.getLogger(__name__)
    log_prefix: str = "adapter"
    max_token_keys: tuple[str, ...] = ()  # body keys capping max_new_tokens, first present wins
    stop_keys: tuple[str, ...] = ()  # body keys carrying stop sequences
    manager: Any

    def __init__(self, *, tokenizer, sglang_url, tool_parser=None, reasoning_parser=None,
                 max_turns_per_sid: int | None = None, fork_threshold_tokens: int | None = None,
                 debug_callback: Callable[..., None] | None = None) -> None:
        require_parsers(tool_parser, reasoning_parser)
        self.tokenizer = tokenizer
        self.sglang_url = sglang_url.rstrip("/") if isinstance(sglang_url, str) else sglang_url
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser
        self.store: dict[str, Any] = {}  # sid -> Session
        self.inflight: dict[str, set[asyncio.Task]] = {}
        self.closed: set[str] = set()
        self.manager = TrajectoryManager(fork_threshold_tokens=fork_threshold_tokens)
        self.debug_callback = debug_callback
        self.max_turns_per_sid = max_turns_per_sid  # past it a session's requests get 429 (a runaway agent)
        self._sid_turn_count: dict[str, int] = {}
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.app.router.add_get("/healthz", _health)
        self.app.router.add_get("/v1/models", _health)
        self._register_routes(self.app)

    # protocol hooks
    def _register_routes(self, app: web.Application) -> None:
        raise NotImplementedError

    def _session_id(self, request: web.Request, body: dict) -> str:
        raise NotImplementedError

    def _preprocess_body(self, body: dict) -> None:
        """Changes the parsed body in place before the session id is read (nothing by default)."""

    def _translate(self, body: dict) -> tuple[list[dict], list[dict] | None]:
        """(chat-template messages, tools schema) of a request body."""
        raise NotImplementedError

    def _build_reply(self, parsed, raw_finish: str, translated: list[dict], tools_schema: list[dict] | None) -> Reply:
        raise NotImplementedError

    async def _respond(self, request: web.Request, body: dict, reply: Reply, in_tok: int, out_tok: int,
                       stream: bool) -> web.StreamResponse:
        raise NotImplementedError

    # sessions
    def open_session(self, sid: str, *, sampling_defaults: dict | None = None, max_context_tokens: int = 0) -> None:
        if sid in self.store:
            raise ValueError(f"session_id {sid!r} already exists; sids must be unique per agent run")
        self.store[sid] = Session(sampling_defaults=dict(sampling_defaults or {}),
                                  max_context_tokens=int(max_context_tokens or 0))

    async def shutdown_session(self, sid: str, *, wait_timeout: float = 5.0) -> None:
        """Refuses the session's later requests and waits up to `wait_timeout` s for those in flight
        (then cancels them); they run on the adapter's own event loop."""
        self.closed.add(sid)
        tasks = [t for t in self.inflight.pop(sid, ()) if not t.done()]
        if not tasks:
            return

        async def drain() -> None:
            _, late = await asyncio.wait(tasks, timeout=wait_timeout)
            for task in late:
                task.cancel()
            if late:
                await asyncio.gather(*late, return_exceptions=True)

        try:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(drain(), tasks[0].get_loop()))
        except Exception:  # noqa: BLE001 - the session ends either way
            self.logger.exception("[%s] sid=%s shutdown drain failed", self.log_prefix, sid)

    async def finish_session(self, sid: str, *, base_sample, reward: float = 0.0, extra_metadata: dict | None = None,
                             wait_timeout: float = 5.0) -> list:
        """The session's samples (`TrajectoryManager.get_trajectory`), each with `.response` decoded from its
        response tokens; [] for a session already finished."""
        await self.shutdown_session(sid, wait_timeout=wait_timeout)
        session = self.store.pop(sid, None)
        budget = int(session.max_context_tokens or 0) if session is not None else 0
        samples = self.manager.get_trajectory(sid, base_sample=base_sample, reward=reward,
                                              extra_metadata=extra_metadata, max_sample_tokens=budget)
        for s in samples:
            n = int(s.response_length or 0)
            s.response = self.tokenizer.decode(s.tokens[-n:], skip_special_tokens=False) if n and s.tokens else ""
        return samples

    async def drop_session(self, sid: str, *, wait_timeout: float = 5.0) -> None:
        await self.shutdown_session(sid, wait_timeout=wait_timeout)
        self.store.pop(sid, None)
        self.manager.drop_session(sid)

    # one turn
    def _check_turn_cap(self, sid: str) -> web.Response | None:
        """429 once a session has had max_turns_per_sid turns; counts the turn otherwise."""
        cap = self.max_turns_per_sid
        if cap is None:
            return None
        done = self._sid_turn_count.get(sid, 0)
        if done >= cap:
            self.logger.warning("[%s] sid=%s exceeded max_turns_per_sid=%d; killing run", self.log_prefix, sid, cap)
            message = f"adapter: sid {sid!r} exceeded max_turns_per_sid={cap}; killing run"
            return web.json_response({"error": {"type": "rate_limit_error", "message": message}}, status=429)
        self._sid_turn_count[sid] = done + 1
        return None

    def _run_debug_callback(self, sid, translated, tools_schema, manager_message, turn) -> None:
        if self.debug_callback is None:
            return
        try:
            self.debug_callback(sid, translated, tools_schema, manager_message, turn)
        except Exception:  # noqa: BLE001 - a debugging aid never fails a turn
            self.logger.exception("debug_callback failed (sid=%s)", sid)

    async def _run_turn(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self._preprocess_body(body)
        sid = self._session_id(request, body)
        if sid in self.closed:
            return web.Response(status=503, text="session closed")
        refused = self._check_turn_cap(sid)
        if refused is not None:
            return refused
        task = asyncio.current_task()
        self.inflight.setdefault(sid, set()).add(task)
        try:
            return await self._turn(request, body, sid, self.store.setdefault(sid, Session()))
        finally:
            self.inflight.get(sid, set()).discard(task)

    async def _turn(self, request: web.Request, body: dict, sid: str, session: Session) -> web.StreamResponse:
        started = time.monotonic()
        translated, tools_schema = self._translate(body)
        prompt_ids = _render_token_ids(translated, self.tokenizer, tools=tools_schema, add_generation_prompt=True)
        turn = await call_sglang_generate(prompt_ids, session, body, adapter=self, session_id=sid)
        raw = self.tokenizer.decode(turn.output_ids, skip_special_tokens=False) if turn.output_ids else ""
        parsed = parse_model_output(raw, tools_schema=tools_schema, tool_parser_name=self.tool_parser,
                                    reasoning_parser_name=self.reasoning_parser)
        reply = self._build_reply(parsed, turn.finish_reason, translated, tools_schema)
        turn = dataclasses.replace(turn, ill_formed=parsed.ill_formed)
        stream = body.get("stream") is True or "text/event-stream" in request.headers.get("Accept", "")
        try:  # answer first: a turn the client never received is not recorded
            response = await self._respond(request, body, reply, len(prompt_ids), len(turn.output_ids), stream)
        except (ConnectionResetError, asyncio.CancelledError) as e:
            self.logger.warning("[%s] sid=%s client disconnected before response flush: %s after %.1fs",
                                self.log_prefix, sid, type(e).__name__, time.monotonic() - started)
            if isinstance(e, asyncio.CancelledError):
                raise
            return web.Response(status=499, text="client disconnected")
        self._run_debug_callback(sid, translated, tools_schema, reply.manager_message, turn)
        self.manager.record_turn(sid, turn=turn, prompt_messages=translated, response_message=reply.manager_message,
                                 metadata={"sid": sid})
        return response
