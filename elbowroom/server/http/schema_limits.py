"""Bounds on the JSON schemas a request asks the engine to compile into a grammar. Pure.

llama.cpp turns ``response_format`` (Ollama's ``format``) and the tools' ``parameters``
into a grammar, and its sampler checks every candidate token against every open
alternative of that grammar. An ``enum`` of 1,000 strings cost 4.6 s per request; 3,000
cost 25.6 s, while another slot's 2-token request went from 0.2 s to 9.5 s; 30,000 kept a
core busy for more than ten minutes after the client left. A repetition bound
(``minItems``, ``maxLength``, ``{n,m}`` in a ``pattern``) is expanded into that many
grammar rules. So the schemas of a request are measured here, from the parsed body, before
a model is even chosen (docs/security.md "JSON schemas and grammars"):

- ``max_schema_bytes``: the schemas' JSON, all together;
- ``max_schema_members``: values of ``enum``, branches of ``anyOf``/``oneOf``/``allOf``,
  entries of a ``type`` list, ``properties``, ``patternProperties``, ``prefixItems``, all
  together;
- ``max_schema_repeat``: any one repetition bound (``minItems``, ``maxItems``,
  ``minLength``, ``maxLength``, ``minProperties``, ``maxProperties``, ``{n}``/``{n,m}`` in
  a ``pattern``).

Nesting is bounded by ``max_json_depth`` (the whole body's).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from elbowroom.errors import BadRequest

_MEMBER_LISTS = ("enum", "anyOf", "oneOf", "allOf", "type", "prefixItems")
_MEMBER_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_REPEATS = (
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "minProperties",
    "maxProperties",
    "minContains",
    "maxContains",
)
_PATTERN_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def schemas_of(body: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Every JSON schema a request body carries, with the param that carries it:
    OpenAI's ``response_format`` and ``text.format`` (Responses), Ollama's ``format``, and
    every tool's ``parameters``."""
    fmt = body.get("response_format")
    if isinstance(fmt, dict):
        inner = fmt.get("json_schema")
        if isinstance(inner, dict) and "schema" in inner:
            yield "response_format", inner["schema"]
        elif "schema" in fmt:
            yield "response_format", fmt["schema"]
    fmt = body.get("format")
    if isinstance(fmt, dict):
        yield "format", fmt
    text = body.get("text")
    if isinstance(text, dict) and isinstance(text.get("format"), dict):
        yield "text.format", text["format"].get("schema")
    tools = body.get("tools")
    for tool in tools if isinstance(tools, list) else ():
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function")
        if isinstance(fn, dict) and "parameters" in fn:
            yield "tools", fn["parameters"]
        elif "parameters" in tool:
            yield "tools", tool["parameters"]


def check_schemas(body: Any, *, max_bytes: int, max_members: int, max_repeat: int) -> None:
    """Raise a 400 naming the limit and its knob when the request's schemas, together,
    pass one of the bounds."""
    if not isinstance(body, dict):
        return
    size = members = 0
    for param, schema in schemas_of(body):
        if schema is None:
            continue
        size += len(json.dumps(schema, separators=(",", ":")))
        if size > max_bytes:
            raise _refused(
                f"The request's JSON schemas take {size} bytes; at most {max_bytes} are "
                "allowed (max_schema_bytes)",
                param,
            )
        members += _members(schema, max_repeat, param)
        if members > max_members:
            raise _refused(
                f"The request's JSON schemas have {members} alternatives (enum values, "
                f"anyOf/oneOf/allOf branches, properties...); at most {max_members} are "
                "allowed (max_schema_members): each one costs the engine time on every "
                "token it samples",
                param,
            )


def _members(schema: Any, max_repeat: int, param: str) -> int:
    """Members of ``schema`` (see the module's docstring); raises past ``max_repeat``. A
    loop, not recursion."""
    total = 0
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
            continue
        if not isinstance(item, dict):
            continue
        for key, value in item.items():
            if (key in _MEMBER_LISTS and isinstance(value, list)) or (
                key in _MEMBER_MAPS and isinstance(value, dict)
            ):
                total += len(value)
            elif key in _REPEATS:
                _check_repeat(value, key, max_repeat, param)
            elif key == "pattern" and isinstance(value, str):
                for low, high in _PATTERN_REPEAT.findall(value):
                    for bound in (low, high):
                        if bound:
                            _check_repeat(int(bound), "pattern", max_repeat, param)
            # Everything is walked, data (a "default", an enum of objects) too: a property
            # named "enum" must not hide a schema, and counting too much is the safe side.
            if isinstance(value, dict | list):
                stack.append(value)
    return total


def _check_repeat(value: Any, key: str, max_repeat: int, param: str) -> None:
    if isinstance(value, int | float) and value > max_repeat:
        raise _refused(
            f"A JSON schema's {key} is {value}; at most {max_repeat} is allowed "
            "(max_schema_repeat): the engine's grammar spells out each repetition",
            param,
        )


def _refused(message: str, param: str) -> BadRequest:
    return BadRequest(message, param=param, code="schema_too_complex")
