"""JSON schemas become llguidance grammars, checked before the engine sees them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from elbowroom.engines import llama_grammar
from elbowroom.engines.llama_grammar import constrain
from elbowroom.errors import BadRequest

NESTED = {"type": "string", "pattern": "^(((a?){0,1024}){0,1024}){0,1024}$"}


def fmt(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def schema_of(grammar: str) -> Any:
    head, _, schema = grammar.partition("start: %json ")
    assert head == "%llguidance {}\n"
    return json.loads(schema)


def test_a_response_format_becomes_an_llguidance_grammar() -> None:
    body = constrain({"messages": [], "response_format": fmt(NESTED)})
    assert "response_format" not in body
    sent = schema_of(body["grammar"])
    assert sent["pattern"] == NESTED["pattern"]
    assert sent["x-guidance"] == llama_grammar.OPTIONS  # fixed separators, lenient


def test_cheap_schemas_stay_with_gbnf_and_costly_ones_go_to_llguidance() -> None:
    """Only what GBNF compiles into counted or regular-expression rules (``COSTLY``) goes
    to llguidance: with its fixed whitespace a 135M model, greedy, never closed
    instructor's nested list nor a json_object answer; GBNF's output it closed."""
    plain = {"messages": [], "response_format": {"type": "json_object"}}
    assert constrain(dict(plain)) == plain
    nested = {"type": "object", "properties": {"cities": {"type": "array", "items": {}}}}
    assert constrain({"prompt": "x", "json_schema": nested}) == {
        "prompt": "x",
        "json_schema": nested,
    }
    short = {"type": "object", "properties": {"code": {"type": "string", "maxLength": 5}}}
    body = constrain({"prompt": "x", "json_schema": short})
    assert "json_schema" not in body and schema_of(body["grammar"])["type"] == "object"
    text = {"messages": [], "response_format": {"type": "text"}}
    assert constrain(dict(text)) == text
    native = {"messages": [], "tools": [{"type": "function"}], "response_format": fmt({})}
    assert constrain(dict(native)) == native  # the engine's own tool grammar


@pytest.mark.parametrize(
    ("schema", "reason"),
    [
        ({"type": "foo"}, "Invalid type: foo"),
        ({"$ref": "#/nowhere"}, "does not exist"),
        ({"type": "integer", "minimum": "x"}, "minimum"),
    ],
)
def test_a_schema_llguidance_cannot_compile_is_a_400(schema: Any, reason: str) -> None:
    """Without the check the engine ran such a request unconstrained (it only logs)."""
    with pytest.raises(BadRequest) as err:
        constrain({"messages": [], "response_format": fmt(schema)})
    assert err.value.status == 400 and err.value.code == "invalid_schema"
    assert reason in err.value.message and err.value.param == "response_format"


def test_keywords_llguidance_lacks_pass_as_before() -> None:
    schema = {"type": "array", "items": {"type": "string"}, "uniqueItems": True, "minItems": 1}
    body = constrain({"messages": [], "response_format": fmt(schema)})
    assert schema_of(body["grammar"])["uniqueItems"] is True


def test_a_repeated_schema_is_checked_once() -> None:
    llama_grammar.grammar.cache_clear()
    for _ in range(3):
        constrain({"messages": [], "response_format": fmt({"enum": ["a", "b"]})})
    info = llama_grammar.grammar.cache_info()
    assert (info.misses, info.hits) == (1, 2)


def test_objects_with_properties_take_no_other_keys_as_gbnf_read_them() -> None:
    """An emulated tool call whose parameters left out additionalProperties ran to
    max_tokens writing keys (llguidance follows JSON Schema: others allowed)."""
    schema = {
        "anyOf": [
            {"type": "object", "properties": {"zone": {"type": "string"}}},
            {"properties": {"properties": {"type": "object", "properties": {}}}},
            {"type": "object", "properties": {}, "additionalProperties": True},
            {"type": "array", "items": {"type": "object", "properties": {"a": {}}}},
        ]
    }
    sent = llama_grammar.closed(schema)
    zone, nested, open_, array = sent["anyOf"]
    assert zone["additionalProperties"] is False
    assert nested["additionalProperties"] is False
    assert set(nested["properties"]) == {"properties"}  # a property named so stays a property
    assert nested["properties"]["properties"]["additionalProperties"] is False
    assert open_["additionalProperties"] is True
    assert array["items"]["additionalProperties"] is False


def test_integers_without_bounds_get_gbnfs_sixteen_digits() -> None:
    """pydantic-ai's City example through the 135M model wrote "population":
    2011000000000… until max_tokens: GBNF had bounded an integer to 16 digits, llguidance
    does not. A bound the client set is kept."""
    schema = {
        "type": "object",
        "properties": {
            "population": {"type": "integer"},
            "age": {"type": "integer", "minimum": 0},
            "ratio": {"type": "number"},
        },
    }
    sent = llama_grammar.closed(schema)
    population, age = sent["properties"]["population"], sent["properties"]["age"]
    assert (population["minimum"], population["maximum"]) == (-(10**16 - 1), 10**16 - 1)
    assert age == {"type": "integer", "minimum": 0}
    assert "maximum" not in sent["properties"]["ratio"]


def test_tools_with_costly_parameters_are_told_apart() -> None:
    """A native template's tool grammar is GBNF: such tools are emulated (engines/llama.py),
    their call schema then sent as llguidance."""

    def tool(parameters: Any) -> dict[str, Any]:
        return {"type": "function", "function": {"name": "f", "parameters": parameters}}

    cheap = tool({"type": "object", "properties": {"city": {"type": "string"}}})
    nested = tool({"type": "object", "properties": {"tags": {"items": {"maxLength": 4}}}})
    assert not llama_grammar.costly_tools([cheap, tool(None), {"type": "function"}])
    assert llama_grammar.costly_tools((cheap, tool({"properties": {"c": NESTED}})))
    assert llama_grammar.costly_tools([nested])
    assert not llama_grammar.costly_tools(None)
