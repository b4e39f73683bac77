"""A model turn's decoded text -> reasoning, visible text and tool calls (upstream slime's
`slime.agent.parsing` contract).

Named formats (`--sglang-reasoning-parser`, `--sglang-tool-call-parser`) are SGLang's own parsers, used as
they are when SGLang is installed (a GPU / NPU rollout host); `require_parsers` refuses a named parser in one
line where it is not. Without a tool parser, or when it finds no call, tool calls written as
`<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>` for a tool the request
offered are taken from the text.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from typing import Any

logger = logging.getLogger(__name__)

_XML_CALL = re.compile(r"<tool_call>\s*<function=([^>]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
_XML_PARAM = re.compile(r"<parameter=([^>]+)>(.*?)</parameter>", re.DOTALL)
THINK_END = "</think>"


@dataclasses.dataclass(frozen=True)
class ParsedModelOutput:
    reasoning: str
    text: str
    tool_uses: list[dict[str, Any]]  # [{"name": ..., "input": {...}}]
    ill_formed: bool = False  # a call's arguments were not JSON


def sglang_parsers_available() -> bool:
    try:
        import sglang.srt.function_call.function_call_parser  # noqa: F401
        import sglang.srt.parser.reasoning_parser  # noqa: F401
    except Exception:  # noqa: BLE001 - e.g. SGLang installed without triton (CPU) fails at import
        return False
    return True


def require_parsers(tool_parser: str | None, reasoning_parser: str | None) -> None:
    """One line when a parser is named that this machine cannot run."""
    named = [f"{flag} {name}" for flag, name in (("--sglang-tool-call-parser", tool_parser),
                                                  ("--sglang-reasoning-parser", reasoning_parser)) if name]
    if named and not sglang_parsers_available():
        raise ValueError(f"{', '.join(named)}: these are SGLang's parsers and SGLang is not installed here; "
                         "install sglang or leave the parser unset (tool calls are then read from "
                         "<tool_call><function=...> text)")


def parse_model_output(raw_output: str, *, tools_schema: list[dict] | None, tool_parser_name: str | None,
                       reasoning_parser_name: str | None) -> ParsedModelOutput:
    reasoning, body = "", raw_output
    if reasoning_parser_name:
        from sglang.srt.parser.reasoning_parser import ReasoningParser

        found, rest = ReasoningParser(model_type=reasoning_parser_name, stream_reasoning=False) \
            .parse_non_stream(raw_output)
        reasoning, body = found or "", rest or ""
        if not reasoning and THINK_END in body:  # a template that opened <think> in the prompt
            reasoning, body = body.split(THINK_END, 1)
    body, tool_uses, ill_formed = parse_tool_uses(body, tools_schema, tool_parser_name)
    return ParsedModelOutput(reasoning=reasoning, text=(body or "").strip(), tool_uses=tool_uses,
                             ill_formed=ill_formed)


def _sglang_tool_calls(body_text: str, tools_schema: list[dict], parser_name: str) -> tuple[str, list]:
    from sglang.srt.entrypoints.openai.protocol import Function, Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    parser = FunctionCallParser(tools=[Tool(type="function", function=Function(**t["function"]))
                                       for t in tools_schema], tool_call_parser=parser_name)
    if not parser.has_tool_call(body_text):
        return body_text, []
    try:
        return parser.parse_non_stream(body_text)
    except Exception:  # noqa: BLE001 - a malformed call: keep the text, the XML form may still match
        logger.exception("SGLang's %s tool-call parser failed on a model turn; trying the XML form", parser_name)
        return body_text, []


def parse_tool_uses(body_text: str, tools_schema: list[dict] | None,
                    tool_parser_name: str | None) -> tuple[str, list[dict[str, Any]], bool]:
    """(text without the calls, [{"name", "input"}], whether a call's arguments were not JSON)."""
    uses: list[dict[str, Any]] = []
    ill_formed = False
    if tool_parser_name and tools_schema:
        body_text, calls = _sglang_tool_calls(body_text, tools_schema, tool_parser_name)
        for call in calls:
            try:
                arguments = json.loads(call.parameters or "{}")
            except json.JSONDecodeError:
                arguments, ill_formed = {"_raw_arguments": call.parameters}, True
            uses.append({"name": call.name or "tool", "input": arguments})
    if tools_schema and not uses:
        body_text, uses = parse_xml_tool_uses(body_text, tools_schema)
    return body_text, uses, ill_formed


def parse_xml_tool_uses(body_text: str, tools_schema: list[dict]) -> tuple[str, list[dict[str, Any]]]:
    """Calls in the XML form to a tool the schema names, cut out of the text (others stay in it)."""
    offered = {t.get("function", {}).get("name") for t in tools_schema}
    uses, kept, pos = [], [], 0
    for m in _XML_CALL.finditer(body_text):
        if m.group(1) not in offered:
            continue
        uses.append({"name": m.group(1),
                     "input": {p.group(1): p.group(2).strip() for p in _XML_PARAM.finditer(m.group(2))}})
        kept.append(body_text[pos:m.start()])
        pos = m.end()
    kept.append(body_text[pos:])
    return "".join(kept), uses
