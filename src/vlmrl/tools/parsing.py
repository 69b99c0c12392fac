"""Tool calls out of model text: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the Qwen2.5 /
Qwen3 / Hermes format). A malformed call becomes a parse error the environment shows the model; it never
raises."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from vlmrl.tools.execute import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
MAX_ERROR_SNIPPET = 80


@dataclass
class ParsedTurn:
    """One assistant turn: ``content`` (the text outside the calls, stripped), ``calls`` (well-formed ones,
    in order) and ``errors`` (one message per malformed call)."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _snippet(body: str) -> str:
    body = " ".join(body.split())
    return body if len(body) <= MAX_ERROR_SNIPPET else body[:MAX_ERROR_SNIPPET] + "..."


def parse_call(body: str) -> ToolCall | str:
    """A ToolCall from the JSON between the tags, or an error message. ``arguments`` may be an object or a
    JSON string holding one (some models write it that way); a missing ``arguments`` means no arguments."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return f"tool call is not valid JSON ({e.msg} at character {e.pos}): {_snippet(body)}"
    if not isinstance(obj, dict):
        return f'tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}, got: {_snippet(body)}'
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f'tool call has no "name" string: {_snippet(body)}'
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return f'tool call {name!r}: "arguments" is a string that is not JSON: {_snippet(args)}'
    if not isinstance(args, dict):
        return f'tool call {name!r}: "arguments" must be a JSON object, got {type(args).__name__}'
    return ToolCall(name=name, arguments=args)


def parse_tool_calls(text: str) -> ParsedTurn:
    """The calls in one assistant turn. An opening tag with no closing one (generation cut off) is a parse
    error; the text after it is not content."""
    calls, errors, content_parts, pos = [], [], [], 0
    for m in CALL_RE.finditer(text):
        content_parts.append(text[pos : m.start()])
        parsed = parse_call(m.group(1).strip())
        (calls if isinstance(parsed, ToolCall) else errors).append(parsed)
        pos = m.end()
    rest = text[pos:]
    if OPEN in rest:
        cut = rest.index(OPEN)
        content_parts.append(rest[:cut])
        errors.append(f"tool call has no closing {CLOSE}: {_snippet(rest[cut + len(OPEN) :])}")
    else:
        content_parts.append(rest)
    return ParsedTurn(content="".join(content_parts).strip(), calls=calls, errors=errors)
