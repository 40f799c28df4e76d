"""A request's JSON schema as an llguidance grammar, checked before the engine sees it.

llama.cpp turns ``response_format`` into a grammar in one of two ways. Its chat endpoint
converts the schema to GBNF, and the GBNF sampler keeps one parse stack per open
alternative; its setup and every token's check run on the engine's one loop that all
slots share. Inside the schema bounds (``server/http/schema_limits.py``) a 21-byte
``{"type": "string", "pattern": "^((a?){0,32}){0,32}$"}`` still held another slot's
2-token chat for 16 s (SmolLM2, 1 thread), and ``{0,1024}`` nested three deep never let
it go. The same engine also runs llguidance grammars (``%llguidance``: a lazy lexer and an
Earley parser with a fuel limit per token): there both schemas cost what a plain request
costs.

So the runner sends every *costly* schema (a ``pattern``, a length or count bound, a
``format``: ``COSTLY``) as a ``grammar`` in llguidance's form, after checking it
with the llguidance library itself (a few ms, cached per schema): a schema llguidance
cannot compile is a 400 naming the reason. Without the check the engine would run such a
request *unconstrained* (it logs the failure and samples freely). ``lenient`` lets keywords
llguidance does not implement (``uniqueItems``, unknown ``format`` names) pass as GBNF
did, unchecked; output whitespace is fixed (``", "`` and ``": "``), as GBNF wrote it, and
an object with ``properties`` takes no other keys unless it says so, as GBNF read it, and
an integer with no bounds has at most 16 digits, as GBNF wrote it (``INTEGER_DIGITS``).

Requests whose tools the chat template handles natively keep llama.cpp's own tool grammar
(GBNF): the engine builds it from the template (always as GBNF) and refuses a ``grammar``
beside ``tools``. Unless a tool's ``parameters`` are costly (``costly_tools``): then the
runner emulates the tools (engines/llama_tools.py) even on such a model, and the call
schema, costly with them, goes here as an llguidance grammar.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

from elbowroom.errors import BadRequest

log = logging.getLogger(__name__)

OPTIONS = {
    "lenient": True,
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}

# What makes GBNF expensive: a regular expression or a repetition count turns into nested
# rules whose parse stacks multiply (``^((a?){0,32}){0,32}$`` held the loop 16 s). A schema
# without them stays with llama.cpp's own GBNF, whose output small models were tuned
# against by every client test (with llguidance's fixed whitespace a 135M model, greedy,
# never closed instructor's nested list, nor a json_object answer).
COSTLY = frozenset(
    {
        "pattern",
        "patternProperties",
        "minLength",
        "maxLength",
        "minItems",
        "maxItems",
        "minProperties",
        "maxProperties",
        "format",
    }
)


def costly(schema: Any) -> bool:
    """Whether ``schema`` has anything GBNF compiles into counted or regular-expression
    rules, anywhere in it."""
    if isinstance(schema, dict):
        return any(k in COSTLY for k in schema) or any(costly(v) for v in schema.values())
    if isinstance(schema, list):
        return any(costly(v) for v in schema)
    return False


def costly_tools(tools: Any) -> bool:
    """Whether any of the OpenAI ``tools`` has costly ``parameters``: as GBNF (a native
    template's tool grammar) they could hold the engine's loop as a costly
    ``response_format`` did."""
    return isinstance(tools, (list, tuple)) and any(
        isinstance(tool, dict)
        and isinstance(tool.get("function"), dict)
        and costly(tool["function"].get("parameters"))
        for tool in tools
    )


def constrain(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` (llama.cpp's request) with its ``response_format`` / ``json_schema`` as an
    llguidance ``grammar`` when the schema is ``costly``; unchanged when it carries none,
    carries ``tools``, or its schema compiles cheaply into GBNF."""
    if body.get("tools") or "grammar" in body:
        return body
    schema: Any = None
    param = "response_format"
    fmt = body.get("response_format")
    if isinstance(fmt, dict):
        kind = fmt.get("type")
        if kind == "json_schema":
            inner = fmt.get("json_schema") or {}
            schema = inner.get("schema", {}) if isinstance(inner, dict) else None
        elif kind == "json_object":
            schema = fmt.get("schema", {"type": "object"})
    if "json_schema" in body:
        schema, param = body["json_schema"], "json_schema"
    if schema is None:
        return body
    text = grammar(json.dumps(schema, sort_keys=True), param)  # every schema is checked
    if not costly(schema):
        return body
    body.pop("response_format", None)
    body.pop("json_schema", None)
    body["grammar"] = text
    return body


@functools.lru_cache(maxsize=128)
def grammar(schema: str, param: str = "response_format") -> str:
    """The llguidance grammar for the JSON ``schema``; BadRequest when llguidance cannot
    compile it. Cached: a client repeating a schema pays the check once."""
    import llguidance

    value = closed(json.loads(schema))
    if isinstance(value, dict):
        value = {**value, "x-guidance": OPTIONS}  # the client's own options are not taken
    text = "%llguidance {}\nstart: %json " + json.dumps(value)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    if failed:
        reason = "; ".join(_first_line(m) for m in messages) or "no reason given"
        raise BadRequest(
            f"the JSON schema cannot be compiled into a grammar: {reason}",
            param=param,
            code="invalid_schema",
        )
    if messages:
        log.info("JSON schema accepted with warnings: %s", "; ".join(messages))
    return text


# llama.cpp's GBNF integer is ``-? ([0-9] | [1-9] [0-9]{0,15})``; llguidance's has no bound,
# and a small model filling an integer field then writes digits until max_tokens
# (pydantic-ai's City example: "population": 201100000000000000000000...).
INTEGER_DIGITS = 16
_INTEGER_BOUND = 10**INTEGER_DIGITS - 1
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")

_SCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists
    ``properties`` and says nothing of others, and 16-digit bounds on every integer that
    has none: how llama.cpp's GBNF converter read them (JSON Schema, and llguidance, would
    allow any other key and any number of digits, and a small model then writes keys or
    digits until ``max_tokens``)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    if (
        isinstance(out.get("properties"), dict)
        and out.get("type", "object") == "object"
        and "additionalProperties" not in out
    ):
        out["additionalProperties"] = False
    if out.get("type") == "integer" and not any(key in out for key in _BOUNDS):
        out["minimum"], out["maximum"] = -_INTEGER_BOUND, _INTEGER_BOUND
    return out


def _first_line(message: str) -> str:
    line = message.strip().splitlines()[0] if message.strip() else message
    return line.split("failed to compile JSON schema: ", 1)[-1]
