"""The OpenAI features of the text routes over a fake scheduler: which params reach the engine
and how, tool calls and logprobs in answers and streams (read with the official openai
client), and a 400 naming the param for everything we do not accept."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import openai
import pytest
from server_fakes import Harness

from elbowroom.engines.requests import TextRequest
from elbowroom.server.openai.schemas import SEED_MODULUS

USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}


def client_for(h: Harness) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://localhost/v1", api_key="unused", http_client=h.client, max_retries=0
    )


def chat(**overrides: Any) -> dict[str, Any]:
    return {"model": "smollm2-135m", "messages": USER, **overrides}


def lp_entry(token: str, logprob: float) -> dict[str, Any]:
    alternatives = [(token, logprob), ("x", logprob - 1), ("y", logprob - 2)]
    return {
        "id": 5,
        "token": token,
        "bytes": list(token.encode()),
        "logprob": logprob,
        "top_logprobs": [
            {"id": 6, "token": t, "bytes": list(t.encode()), "logprob": lp}
            for t, lp in alternatives
        ],
    }


def test_params_reach_the_engine_validated_and_converted(harness: Harness) -> None:
    big_seed = (1 << 40) + 7
    r = harness.client.post(
        "/v1/chat/completions",
        json=chat(
            tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            parallel_tool_calls=False,
            response_format={"type": "text"},
            logprobs=True,
            top_logprobs=0,
            seed=big_seed,
            presence_penalty=1.5,
            frequency_penalty=-0.5,
            logit_bias={"42": -100, "7": 3.5},
        ),
    )
    assert r.status_code == 200, r.text
    kind, text = harness.scheduler.requests[0]
    assert kind == "open" and isinstance(text, TextRequest) and text.kind == "chat"
    assert text.tools == (WEATHER, TIME)
    assert text.tool_choice == {"type": "function", "function": {"name": "get_time"}}
    assert text.parallel_tool_calls is False
    assert text.response_format == {"type": "text"}
    # top_logprobs 0 makes the engine send no logprobs at all: it is asked for one.
    assert text.logprobs == 1
    assert text.seed == big_seed % SEED_MODULUS
    assert text.presence_penalty == 1.5 and text.frequency_penalty == -0.5
    assert text.logit_bias == {"42": -100, "7": 3.5}
    # The answer still has no alternatives, as asked.
    assert r.json()["choices"][0]["logprobs"] == {"content": [], "refusal": None}


def test_json_schema_and_tool_turns_reach_the_engine_as_openai_dicts(harness: Harness) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
    ]
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}
    r = harness.client.post(
        "/v1/chat/completions", json=chat(messages=messages, response_format=fmt)
    )
    assert r.status_code == 200, r.text
    text = harness.scheduler.requests[0][1]
    assert text.response_format == fmt
    assert list(text.messages[1:]) == [
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]


def test_tool_call_answer(harness: Harness) -> None:
    harness.scheduler.script.pieces = ()
    harness.scheduler.script.finish_reason = "tool_calls"
    harness.scheduler.script.done_extra = {"tool_calls": [CALL]}
    out = client_for(harness).chat.completions.create(
        model="smollm2-135m", messages=USER, tools=[WEATHER], tool_choice="required"
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls is not None
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]


def assemble(chunks: list[Any]) -> dict[int, dict[str, str]]:
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for d in (chunk.choices[0].delta.tool_calls or ()) if chunk.choices else ():
            call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += d.id or ""
            call["name"] += (d.function.name if d.function else None) or ""
            call["arguments"] += (d.function.arguments if d.function else None) or ""
    return calls


def test_streamed_tool_call_deltas_and_logprobs(harness: Harness) -> None:
    script = harness.scheduler.script
    script.pieces = ("Hi",)
    script.finish_reason = "tool_calls"
    script.deltas = (
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                         "function": {"name": "get_weather"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}],
         "logprobs": [lp_entry('{"', -0.5)]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
    )  # fmt: skip
    script.done_extra = {"tool_calls": [CALL], "logprobs": [lp_entry('{"', -0.5)]}
    chunks = list(
        client_for(harness).chat.completions.create(
            model="smollm2-135m",
            messages=USER,
            tools=[WEATHER],
            logprobs=True,
            top_logprobs=2,
            stream=True,
        )
    )
    assert assemble(chunks) == {
        0: {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    }
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or ()
    ]
    assert [e.token for e in streamed] == ['{"']  # not repeated at the end
    assert len(streamed[0].top_logprobs) == 2
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [
        "tool_calls"
    ]


def test_calls_and_logprobs_known_only_at_the_end_still_stream(harness: Harness) -> None:
    """Emulated tool calls (templates without tool support) are parsed from the whole reply:
    the engine reports them with the result; the stream must still carry them."""
    script = harness.scheduler.script
    script.pieces = ()
    script.finish_reason = "tool_calls"
    script.done_extra = {"tool_calls": [CALL], "logprobs": [lp_entry("{", -0.1)]}
    chunks = list(
        client_for(harness).chat.completions.create(
            model="smollm2-135m", messages=USER, tools=[WEATHER], logprobs=True, stream=True
        )
    )
    assert assemble(chunks) == {
        0: {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    }
    late = [c for c in chunks if c.choices and c.choices[0].logprobs]
    assert len(late) == 1 and late[0].choices[0].logprobs.content[0].top_logprobs == []  # type: ignore[union-attr]


def test_completion_legacy_logprobs_whole_and_streamed(harness: Harness) -> None:
    script = harness.scheduler.script
    script.pieces = ("Hel", "lo")
    script.deltas = ()
    entries = [lp_entry("Hel", -0.1), lp_entry("lo", -0.2)]
    script.done_extra = {"logprobs": entries}
    c = client_for(harness)
    out = c.completions.create(model="smollm2-135m", prompt="x", logprobs=2)
    assert harness.scheduler.requests[-1][1].logprobs == 2
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens == ["Hel", "lo"] and lp.text_offset == [0, 3]
    assert lp.top_logprobs == [{"Hel": -0.1, "x": -1.1}, {"lo": -0.2, "x": -1.2}]
    # Streamed: the fake runner sends the logprobs only with the result (see above).
    chunks = list(c.completions.create(model="smollm2-135m", prompt="x", logprobs=0, stream=True))
    assert harness.scheduler.requests[-1][1].logprobs == 1
    got = [
        t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens or ()
    ]
    assert got == ["Hel", "lo"]
    assert all(
        ch.choices[0].logprobs.top_logprobs is None for ch in chunks if ch.choices[0].logprobs
    )


IGNORED = {
    "user": "u1",
    "metadata": {"k": "v"},
    "store": False,
    "service_tier": "auto",
    "prompt_cache_key": "agent-7",
    "safety_identifier": "h4sh",
    "modalities": ["text"],
    "stream_options": {"include_usage": False, "include_obfuscation": False},
    "functions": None,  # null is absence, even for refused params
}


def test_harmless_openai_params_are_accepted_and_go_nowhere(harness: Harness) -> None:
    r = harness.client.post("/v1/chat/completions", json=chat(**IGNORED))
    assert r.status_code == 200, r.text
    text = harness.scheduler.requests[0][1]
    assert not set(IGNORED) & {f.name for f in dataclasses.fields(text)}


def bad(body: dict[str, Any], param: str | None, fragment: str) -> tuple[Any, ...]:
    return (body, param, fragment)


BAD_CHAT = [
    bad(chat(top_k=-1), "top_k", "greater than or equal to 0"),
    bad(
        chat(messages=[{"role": "user", "content": "x", "mood": "happy"}]),
        "messages[0].mood",
        "Unsupported",
    ),
    bad(chat(stream_options={"include_usage": True, "x": 1}), "stream_options.x", "Unsupported"),
    bad(chat(functions=[{"name": "f"}]), "functions", "send tools"),
    bad(chat(function_call="auto"), "function_call", "tool_choice"),
    bad(chat(audio={"voice": "alloy"}), "audio", "audio output"),
    bad(chat(modalities=["text", "audio"]), "modalities", "['text']"),
    bad(chat(reasoning_effort="high"), "reasoning_effort", "not supported"),
    bad(chat(prediction={"type": "content", "content": "x"}), "prediction", "not supported"),
    bad(chat(tools=WEATHER), "tools", "list"),
    bad(chat(tools=[]), "tools", "at least 1"),
    bad(chat(tools=[{"type": "custom", "custom": {"name": "x"}}]), "tools[0].type", "function"),
    bad(
        chat(tools=[{"type": "function", "function": {"name": "get weather"}}]),
        "tools[0].function.name",
        "pattern",
    ),
    bad(
        chat(
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]
        ),
        "tools[0].function.parameters",
        "object",
    ),
    bad(chat(tools=[WEATHER, WEATHER]), "tools", "unique"),
    bad(
        chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}}),
        "tool_choice",
        "not in tools",
    ),
    bad(chat(tool_choice="required"), "tool_choice", "needs tools"),
    bad(chat(tools=[WEATHER], tool_choice="always"), "tool_choice", "'none', 'auto', 'required'"),
    bad(chat(tools=[WEATHER], tool_choice={"type": "function"}), "tool_choice", "function"),
    bad(chat(tools=[WEATHER], parallel_tool_calls="yes"), "parallel_tool_calls", "boolean"),
    bad(chat(response_format={"type": "xml"}), "response_format.type", "json_schema"),
    bad(chat(response_format={"type": "json_schema"}), "response_format", "needs json_schema"),
    bad(
        chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
        "response_format.json_schema.name",
        "Missing required",
    ),
    bad(chat(response_format="json"), "response_format", ""),
    bad(chat(logprobs="yes"), "logprobs", "boolean"),
    bad(chat(top_logprobs=3), "top_logprobs", "needs logprobs"),
    bad(chat(logprobs=True, top_logprobs=21), "top_logprobs", "20"),
    bad(chat(presence_penalty=2.5), "presence_penalty", "2"),
    bad(chat(frequency_penalty="high"), "frequency_penalty", ""),
    bad(chat(logit_bias={"hello": 1}), "logit_bias", "token ids"),
    bad(chat(logit_bias={"42": 101}), "logit_bias.42", "100"),
    bad(chat(logit_bias={"49152": 1}), "logit_bias", "not in the vocabulary"),
    bad(chat(seed="1"), "seed", "integer"),
    bad(chat(seed=1 << 64), "seed", ""),
    bad(
        chat(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
                    ],
                }
            ]
        ),
        "messages[0].content[0].type",
        "has no vision",
    ),
    bad(
        chat(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
                    ],
                }
            ]
        ),
        "messages[0].content[0].type",
        "transcriptions",
    ),
    bad(
        chat(
            messages=[
                {"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        ),
        "messages[0]",
        "role 'system'",
    ),
    bad(chat(messages=[{"role": "tool", "content": "sunny"}]), "messages[0]", "tool_call_id"),
    bad(
        chat(messages=[*USER, {"role": "tool", "tool_call_id": "nope", "content": "x"}]),
        "messages",
        "no earlier",
    ),
    bad(
        chat(messages=[{"role": "user", "content": "x", "tool_calls": [CALL]}]),
        "messages[0]",
        "only assistant",
    ),
    bad(chat(messages=[{"role": "user", "content": None}]), "messages[0]", "needs content"),
    bad(
        chat(messages=[{"role": "function", "name": "f", "content": "x"}]),
        "messages[0].role",
        "tool",
    ),
    bad(
        chat(
            messages=[
                {
                    "role": "assistant",
                    "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {}}}],
                }
            ]
        ),
        "messages[0].tool_calls[0].function.arguments",
        "string",
    ),
]


@pytest.mark.parametrize(("body", "param", "fragment"), BAD_CHAT, ids=[str(b[1]) for b in BAD_CHAT])
def test_bad_chat_feature_params_are_a_400_naming_the_param(
    harness: Harness, body: dict[str, Any], param: str | None, fragment: str
) -> None:
    r = harness.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert fragment in err["message"], err["message"]
    assert harness.scheduler.requests == []


BAD_COMPLETION = [
    ({"logprobs": 6}, "logprobs", "5"),
    ({"logprobs": True}, "logprobs", "integer"),
    ({"best_of": 3}, "best_of", "one completion"),
    ({"tools": [WEATHER]}, "tools", "Unsupported"),
    ({"logit_bias": {"99999": 1}}, "logit_bias", "vocabulary"),
]


@pytest.mark.parametrize(("extra", "param", "fragment"), BAD_COMPLETION)
def test_bad_completion_feature_params(
    harness: Harness, extra: dict[str, Any], param: str, fragment: str
) -> None:
    r = harness.client.post("/v1/completions", json={"prompt": "x", **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"], err
    assert harness.scheduler.requests == []
