"""OpenAI features through a real `elbowroom serve` (SmolLM2 on llama.cpp's server engine),
driven by the official openai client: structured output, tools (emulated: SmolLM2's chat
template has no tool support), logprobs, seeds, penalties and the 400s for what we refuse.
Replies are kept short (max_tokens) so the module stays fast on 2 cores."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from serverproc import ServerFactory, ServerProcess

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["C", "F"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string"}},
            "required": ["zone"],
        },
    },
}
TOOLS: Any = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(server_factory: ServerFactory) -> ServerProcess:
    return server_factory("--ctx", "1024")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.openai()


def socket_streams(server: ServerProcess, model: str = MODEL) -> dict[str, int]:
    """The engine's count of requests relayed from its own socket, in all and by what the
    relay rewrites (engines/llama.py ``open``): the path each request took."""
    (row,) = [r for r in server.ps() if r["id"] == model]
    counts: dict[str, int] = row["engine_stats"]["socket_streams"]
    return counts


def assert_valid_call(name: str, arguments: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """A call to one of ``tools`` whose arguments are a JSON object with the required keys of
    that tool's schema, each of the declared type."""
    fns = {t["function"]["name"]: t["function"] for t in tools}
    assert name in fns, f"{name!r} is not one of {sorted(fns)}"
    args = json.loads(arguments)
    schema = fns[name]["parameters"]
    assert isinstance(args, dict) and set(schema["required"]) <= set(args), args
    for key, value in args.items():
        prop = schema["properties"][key]
        assert (
            isinstance(value, str) and len(value) <= prop["maxLength"]
            if "maxLength" in prop
            else True
        )
        assert value in prop["enum"] if "enum" in prop else True
    return args


def test_json_schema_strict_output_validates(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
            "capital": {"type": "boolean"},
        },
        "required": ["city", "population_millions", "capital"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": schema, "strict": True},
        },
        max_tokens=50,
        temperature=0,
    )
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    data = json.loads(out.choices[0].message.content or "")
    assert set(data) == {"city", "population_millions", "capital"}
    assert isinstance(data["city"], str)
    assert isinstance(data["population_millions"], int) and 0 <= data["population_millions"] <= 100
    assert isinstance(data["capital"], bool)


def test_json_object_output_parses(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": 'Reply with JSON like {"answer": 4}: what is 2+2?'}],
        response_format={"type": "json_object"},
        max_tokens=40,
        temperature=0,
    )
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    assert isinstance(json.loads(out.choices[0].message.content or ""), dict)


@pytest.mark.parametrize(
    ("tools", "choice"),
    [
        ([WEATHER], "required"),
        (TOOLS, {"type": "function", "function": {"name": "get_time"}}),
        ([WEATHER], "auto"),
    ],
    ids=["required", "named", "auto"],
)
def test_tool_choice_yields_a_valid_call_streamed_the_same(
    client: openai.OpenAI, server: ServerProcess, tools: Any, choice: Any
) -> None:
    kw: Any = {"model": MODEL, "messages": ASK, "tools": tools, "tool_choice": choice}
    kw.update(max_tokens=60, temperature=0)
    out = client.chat.completions.create(**kw)
    msg = out.choices[0].message
    if choice == "auto" and not msg.tool_calls:  # auto may answer in words
        assert out.choices[0].finish_reason == "stop" and msg.content
        return
    assert out.choices[0].finish_reason == "tool_calls" and msg.tool_calls
    call = msg.tool_calls[0]
    assert call.type == "function" and call.id
    assert_valid_call(call.function.name, call.function.arguments, tools)  # type: ignore[union-attr]
    if isinstance(choice, dict):
        assert call.function.name == "get_time"  # type: ignore[union-attr]
    if choice != "required":
        return  # every emulated call streams the same way (one delta at the end): once is enough

    before = socket_streams(server)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    after = socket_streams(server)
    # Emulated calls are read from the engine's socket like every request (and parsed at
    # the end by the relay), not carried token by token through the runner.
    assert after["emulated_tools"] == before["emulated_tools"] + 1
    assert after["all"] == before["all"] + 1
    name, arguments, ids = "", "", set()
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            assert d.index == 0
            ids.add(d.id) if d.id else None
            name += (d.function.name if d.function else None) or ""
            arguments += (d.function.arguments if d.function else None) or ""
    assert len(ids) == 1
    assert (name, json.loads(arguments)) == (
        call.function.name,  # type: ignore[union-attr]
        json.loads(call.function.arguments),  # type: ignore[union-attr]
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [
        "tool_calls"
    ]


def test_a_tool_result_turn_reaches_the_model(client: openai.OpenAI) -> None:
    call = {
        "id": "call_abc",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    turns: Any = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "Sunny, 21 degrees C"},
    ]
    out = client.chat.completions.create(
        model=MODEL, messages=turns, tools=TOOLS, max_tokens=60, temperature=0
    )
    msg = out.choices[0].message
    if msg.tool_calls:
        assert_valid_call(
            msg.tool_calls[0].function.name, msg.tool_calls[0].function.arguments, TOOLS
        )  # type: ignore[union-attr]
    else:
        assert msg.content
    bare = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=1, temperature=0
    )
    assert out.usage is not None and bare.usage is not None
    assert out.usage.prompt_tokens > bare.usage.prompt_tokens + 10  # the call and its result


def test_chat_logprobs_whole_and_streamed(client: openai.OpenAI, server: ServerProcess) -> None:
    before = socket_streams(server)
    kw: Any = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    out = client.chat.completions.create(**kw)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.content is not None and out.usage is not None
    assert len(lp.content) == out.usage.completion_tokens == 4
    assert "".join(t.token for t in lp.content) == out.choices[0].message.content
    for t in lp.content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        alts = [a.logprob for a in t.top_logprobs]
        assert alts == sorted(alts, reverse=True)
        assert t.top_logprobs[0].token == t.token  # greedy: the sampled token is the likeliest
    streamed = [
        t.token
        for c in client.chat.completions.create(**kw, stream=True)
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content or ()
    ]
    assert streamed == [t.token for t in lp.content]
    none = client.chat.completions.create(**{**kw, "top_logprobs": 0})
    assert none.choices[0].logprobs is not None
    assert [t.top_logprobs for t in none.choices[0].logprobs.content or ()] == [[]] * 4
    # All three (whole, streamed, no alternatives) came from the engine's socket.
    after = socket_streams(server)
    assert after["logprobs"] == before["logprobs"] + 3 and after["all"] == before["all"] + 3


def test_completion_legacy_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt="1, 2, 3,", max_tokens=3, temperature=0, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == 3 and "".join(lp.tokens) == out.choices[0].text
    assert lp.top_logprobs is not None and all(1 <= len(d) <= 2 for d in lp.top_logprobs)
    assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]


def test_seed_repeats_at_temperature_one(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        out = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=10,
            temperature=1.0,
            seed=seed,
        )
        return out.choices[0].message.content or ""

    first = sample(1234)
    assert first and sample(1234) == first
    # A seed beyond 32 bits works too (reduced modulo 2**32 - 1).
    assert sample((1 << 40) + 1234) == sample((1 << 40) + 1234)


def test_penalties_and_logit_bias_reach_the_engine(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=4,
        presence_penalty=1.5,
        frequency_penalty=-0.5,
        temperature=0,
    )
    assert out.choices[0].message.content
    # Token 28 is "," in SmolLM2's vocabulary: a +100 bias makes it the only choice.
    forced = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logit_bias={"28": 100}
    )
    assert forced.choices[0].text == ",,,"


def test_refusals_are_400s_naming_the_param(client: openai.OpenAI, server: ServerProcess) -> None:
    def refused(param: str, **kw: Any) -> str:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                **{"model": MODEL, "messages": ASK, "max_tokens": 2, **kw}
            )
        body: Any = info.value.body
        assert body["param"] == param, body
        return str(body["message"])

    # top_k is llama.cpp's sampler now (issue 21); a field nobody implements is still a 400.
    assert "Unsupported parameter" in refused("tfs_z", extra_body={"tfs_z": 0.9})
    refused("max_tokens", max_tokens="abc")
    refused("temperature", temperature="hot")
    refused("tools", tools={"type": "function"})
    assert "not in tools" in refused(
        "tool_choice", tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}
    )
    vision = [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]
    assert "no vision" in refused(
        "messages[0].content[0].type", messages=[{"role": "user", "content": vision}]
    )
    # ... and the server still answers.
    assert server.http().get("/health").json() == {"status": "ok"}


def test_logprobs_on_a_model_without_chat_template(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    """gemma3-270m has no chat template: chat runs through the completion endpoint, which
    names logprobs differently; they must still come back, streamed too, read from the
    engine's socket."""
    if "gemma3-270m" not in {m.id for m in client.models.list().data}:
        pytest.skip("the gemma3 chunk packages are not installed")
    kw: Any = {
        "model": "gemma3-270m",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    out = client.chat.completions.create(**kw)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.content and all(len(t.top_logprobs) == 2 for t in lp.content)
    before = socket_streams(server, "gemma3-270m")
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = [
        t.token
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content or ()
    ]
    assert streamed == [t.token for t in lp.content]  # greedy: the same tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    after = socket_streams(server, "gemma3-270m")
    assert after["transcript"] == before["transcript"] + 1
    assert after["logprobs"] == before["logprobs"] + 1
