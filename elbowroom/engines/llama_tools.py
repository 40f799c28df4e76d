"""PURE: tool calling that always yields a valid call when the client demands one.

Two paths, chosen per request:

- **Native**: the model's chat template knows tools (the engine reports
  ``supports_tool_calls``). ``tools`` and ``tool_choice`` go to the engine, which renders
  them with the template and parses the calls it streams. llama.cpp ignores a *named*
  ``tool_choice`` (it warns and falls back to ``auto``), so a named choice is sent as
  ``tools=[that one]`` with ``tool_choice="required"``: the grammar then admits only it.
- **Emulated**: the template has no tool support (SmolLM2, base models), so the engine would
  answer in prose; or a tool's parameters are costly as a GBNF grammar (a ``pattern``,
  length/count bounds, a ``format``: engines/llama_grammar.py ``costly_tools``). The tools
  are described in a system message and the output is constrained by a JSON schema:
  ``required`` / named → exactly a call object ``{"name": ..., "arguments": {...}}``;
  ``auto`` → a call object or ``{"content": "..."}``.
  The JSON is parsed back into a tool call (or plain content) when the generation ends, so
  emulated calls arrive as one delta at the end of a stream.

``tool_choice="none"`` drops the tools for both paths.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from elbowroom.errors import BadRequest

INSTRUCTION = (
    "You can call these tools. Reply with only a JSON object: "
    '{"name": <tool name>, "arguments": <arguments object>} to call a tool'
)
AUTO_INSTRUCTION = ', or {"content": <your reply>} to answer without a tool.'


@dataclass(frozen=True, slots=True)
class ToolPlan:
    body: dict[str, Any]  # the engine request body (tools handled)
    emulated: bool  # parse the output as a call object at the end


def plan(body: dict[str, Any], native: bool) -> ToolPlan:
    """Rewrite ``body`` (an OpenAI chat request) for the engine; ``native``: the template
    supports tool calls."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    body = {k: v for k, v in body.items() if k not in ("tools", "tool_choice")}
    if not tools or choice == "none":
        return ToolPlan(body, emulated=False)
    tools = [_inlined(t) for t in tools]
    named = _named(choice, tools)
    if native:
        if named is not None:
            return ToolPlan({**body, "tools": [named], "tool_choice": "required"}, False)
        return ToolPlan({**body, "tools": tools, "tool_choice": choice or "auto"}, False)
    if body.get("response_format") not in (None, {"type": "text"}):
        raise BadRequest(
            "tools and response_format together are not supported here: the tools are "
            "emulated with a JSON schema (the model's chat template has no tool support, or "
            "a tool's parameters use pattern, length or count bounds, or format)",
            param="response_format",
        )
    offered = [named] if named is not None else list(tools)
    calls = [_call_schema(t) for t in offered]
    auto = named is None and choice in (None, "auto")
    variants = [*calls, _content_schema()] if auto else calls
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    listing = json.dumps([t["function"] for t in offered], separators=(",", ":"))
    system = {
        "role": "system",
        "content": f"{INSTRUCTION}{AUTO_INSTRUCTION if auto else '.'}\nTools: {listing}",
    }
    messages = [system, *(_plain_tool_turns(m) for m in body.get("messages", []))]
    return ToolPlan(
        {
            **body,
            "messages": messages,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "tool_call", "strict": True, "schema": schema},
            },
        },
        emulated=True,
    )


def parse(text: str) -> tuple[str, list[dict[str, Any]]]:
    """An emulated reply -> (content, tool_calls). Output the grammar cut short (max_tokens)
    is not valid JSON: it is returned as content, with no call."""
    try:
        obj = json.loads(text)
    except ValueError:
        return text, []
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        args = obj.get("arguments", {})
        call = {
            "id": "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args)},
        }
        return "", [call]
    if isinstance(obj, dict) and isinstance(obj.get("content"), str):
        return obj["content"], []
    return text, []


def _named(choice: Any, tools: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not isinstance(choice, dict):
        return None
    name = (choice.get("function") or {}).get("name")
    for tool in tools:
        if tool["function"]["name"] == name:
            return tool
    raise BadRequest(f"tool_choice names {name!r}, which is not in tools", param="tool_choice")


class _Recursive(Exception):
    pass


_DEF_TABLES = ("$defs", "definitions")


def _inlined(tool: dict[str, Any]) -> dict[str, Any]:
    """``tool`` with the local ``$ref``s of its parameters replaced by what they name.

    Pydantic writes a nested model as ``{"$ref": "#/$defs/City"}`` with ``$defs`` at the
    parameters' root (instructor's default mode sends every response model so). Both
    paths nest the parameters inside a call object (``{"name", "arguments": <params>}``),
    where ``#/$defs`` no longer points at them: llama.cpp then refuses the request
    ("cannot resolve $ref #/$defs/City"). A recursive model cannot be inlined and is sent
    as it came."""
    fn = tool.get("function")
    if not isinstance(fn, dict):
        return tool
    params = fn.get("parameters")
    if not isinstance(params, dict) or not any(k in params for k in _DEF_TABLES):
        return tool
    try:
        inlined = _resolve(params, params, frozenset(), root=True)
    except _Recursive:
        return tool
    return {**tool, "function": {**fn, "parameters": inlined}}


def _resolve(node: Any, root_schema: dict[str, Any], seen: frozenset[str], root: bool) -> Any:
    if isinstance(node, list):
        return [_resolve(v, root_schema, seen, False) for v in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str):
        table, _, name = ref.removeprefix("#/").partition("/")
        target = (root_schema.get(table) or {}).get(name) if table in _DEF_TABLES else None
        if isinstance(target, dict):
            if ref in seen:
                raise _Recursive(ref)
            rest = {k: v for k, v in node.items() if k != "$ref"}
            return _resolve({**target, **rest}, root_schema, seen | {ref}, False)
    return {
        k: _resolve(v, root_schema, seen, False)
        for k, v in node.items()
        if not (root and k in _DEF_TABLES)
    }


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _content_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"content": {"type": "string"}},
        "required": ["content"],
        "additionalProperties": False,
    }


def _plain_tool_turns(msg: dict[str, Any]) -> dict[str, Any]:
    """Earlier tool calls and results as text, for templates that cannot render them."""
    if msg.get("role") == "assistant" and msg.get("tool_calls"):
        calls = [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in msg["tool_calls"]
        ]
        return {"role": "assistant", "content": json.dumps(calls[0] if len(calls) == 1 else calls)}
    if msg.get("role") == "tool":
        return {"role": "user", "content": f"Tool result: {msg.get('content') or ''}"}
    return msg
