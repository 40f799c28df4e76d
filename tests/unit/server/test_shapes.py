"""The exact OpenAI bodies (shapes.py), parsed back by the official openai client's types:
a shape the client cannot read is a failing test here, not a surprise for a user."""

from __future__ import annotations

from typing import Any

from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_choice import Logprobs as CompletionLogprobs

from elbowroom.server.openai.shapes import Envelope, Logprobs

USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "cached_tokens": 2}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}


def entry(token: str, logprob: float, alternatives: list[tuple[str, float]]) -> dict[str, Any]:
    """One logprob entry as the engine sends it (with llama.cpp's extra ``id``)."""
    return {
        "id": 1,
        "token": token,
        "bytes": list(token.encode()),
        "logprob": logprob,
        "top_logprobs": [
            {"id": 2, "token": t, "bytes": list(t.encode()), "logprob": lp}
            for t, lp in alternatives
        ],
    }


ENTRIES = [
    entry("Hel", -0.1, [("Hel", -0.1), ("Hi", -2.5), ("Yo", -4.0)]),
    entry("lo", -0.2, [("lo", -0.2), ("p", -3.0), ("!", -5.0)]),
]


def test_chat_response_with_tool_calls_has_null_content() -> None:
    env = Envelope.new("chat", "smollm2-135m", 1)
    body = env.response("", "tool_calls", USAGE, tool_calls=[CALL])
    out = ChatCompletion.model_validate(body)
    msg = out.choices[0].message
    assert msg.content is None and out.choices[0].finish_reason == "tool_calls"
    assert msg.tool_calls is not None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.id == "call_1" and call.type == "function"
    assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Paris"}'
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens == 2 and out.usage.total_tokens == 10


def test_chat_response_without_tools_has_no_tool_calls_key() -> None:
    body = Envelope.new("chat", "m", 1).response("Hello", "stop", USAGE)
    assert "tool_calls" not in body["choices"][0]["message"]
    assert body["choices"][0]["message"]["content"] == "Hello"
    assert body["choices"][0]["logprobs"] is None


def test_chat_logprobs_are_trimmed_to_what_was_asked_and_drop_engine_keys() -> None:
    view = Logprobs("chat", top=2)
    body = Envelope.new("chat", "m", 1).response(
        "Hello", "stop", USAGE, logprobs=view.render(ENTRIES)
    )
    lp = ChatCompletion.model_validate(body).choices[0].logprobs
    assert lp is not None and lp.content is not None
    assert [t.token for t in lp.content] == ["Hel", "lo"]
    assert [len(t.top_logprobs) for t in lp.content] == [2, 2]
    assert lp.content[0].top_logprobs[1].token == "Hi"
    assert lp.content[0].bytes == list(b"Hel")
    assert "id" not in body["choices"][0]["logprobs"]["content"][0]
    none = Logprobs("chat", top=0).render(ENTRIES)
    assert [e["top_logprobs"] for e in none["content"]] == [[], []]


def test_legacy_completion_logprobs_and_offsets_across_chunks() -> None:
    view = Logprobs("completion", top=1)
    env = Envelope.new("completion", "m", 1)
    # (The client reads stream chunks without validating them: a mid-stream completion
    # chunk's finish_reason null is not in its Completion type, so check the logprobs type.)
    first = env.chunk("Hel", logprobs=view.render(ENTRIES[:1]))["choices"][0]
    second = env.chunk("lo", logprobs=view.render(ENTRIES[1:]))["choices"][0]
    lp1 = CompletionLogprobs.model_validate(first["logprobs"])
    lp2 = CompletionLogprobs.model_validate(second["logprobs"])
    assert lp1.tokens == ["Hel"] and lp2.tokens == ["lo"]
    assert lp1.token_logprobs == [-0.1] and lp2.token_logprobs == [-0.2]
    assert lp1.top_logprobs == [{"Hel": -0.1}] and lp2.top_logprobs == [{"lo": -0.2}]
    assert lp1.text_offset == [0] and lp2.text_offset == [3]  # continues across chunks
    whole = Logprobs("completion", top=0).render(ENTRIES)
    body = env.response("Hello", "length", USAGE, logprobs=whole)
    assert Completion.model_validate(body).choices[0].logprobs is not None
    assert whole["top_logprobs"] is None and whole["text_offset"] == [0, 3]


def test_streamed_tool_call_deltas_assemble_to_the_call() -> None:
    env = Envelope.new("chat", "m", 1)
    pieces = [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather"}},
        {"index": 0, "function": {"arguments": '{"city": '}},
        {"index": 0, "function": {"arguments": '"Paris"}'}},
    ]
    chunks = [ChatCompletionChunk.model_validate(env.chunk(None, tool_calls=[p])) for p in pieces]
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        assert chunk.choices[0].delta.content is None
        for d in chunk.choices[0].delta.tool_calls or ():
            call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += d.id or ""
            if d.function is not None:
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
    assert calls == {0: {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}}
    # Only the first piece of a call carries id and type.
    assert (
        "id" not in env.chunk(None, tool_calls=[pieces[1]])["choices"][0]["delta"]["tool_calls"][0]
    )


def test_chunks_carry_logprobs_and_reasoning() -> None:
    env = Envelope.new("chat", "m", 1)
    body = env.chunk(
        "Hel",
        logprobs=Logprobs("chat", 1).render(ENTRIES[:1]),
        reasoning="thinking",
        include_usage=True,
    )
    chunk = ChatCompletionChunk.model_validate(body)
    assert chunk.choices[0].logprobs is not None and chunk.choices[0].logprobs.content is not None
    assert chunk.choices[0].logprobs.content[0].token == "Hel"
    assert body["choices"][0]["delta"]["reasoning_content"] == "thinking"
    assert body["usage"] is None
