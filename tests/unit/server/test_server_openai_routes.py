"""The OpenAI text routes over a fake scheduler, read back with the official openai client."""

from __future__ import annotations

import json
import math

import openai
import pytest
from server_fakes import Harness

from elbowroom.engines.requests import TextRequest
from elbowroom.errors import (
    ContextOverflow,
    InsufficientMemory,
    MemoryPressure,
    QueueFull,
    RunnerCrashed,
)


def client_for(h: Harness) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://localhost/v1", api_key="unused", http_client=h.client, max_retries=0
    )


def sse_events(text: str) -> list[str]:
    return [line.removeprefix("data: ") for line in text.split("\n\n") if line.strip()]


def test_models_list_and_get(harness: Harness) -> None:
    models = client_for(harness).models.list()
    ids = [m.id for m in models.data]
    assert ids == ["smollm2-135m", "whisper-tiny.en"]
    raw = harness.client.get("/v1/models").json()
    assert raw["object"] == "list"
    assert raw["data"][1]["kind"] == "asr" and raw["data"][1]["engine"] == "whisper"
    assert client_for(harness).models.retrieve("smollm2-135m").owned_by == "elbowroom"


def test_chat_non_streaming(harness: Harness) -> None:
    out = client_for(harness).chat.completions.create(
        model="smollm2-135m",
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        ],
        max_tokens=5,
        temperature=0.0,
        seed=3,
        stop="\n",
        user="someone",
    )
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.content == "Hello!"
    assert out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.total_tokens == 10
    assert out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens == 2
    kind, text = harness.scheduler.requests[0]
    assert kind == "open" and isinstance(text, TextRequest) and text.kind == "chat"
    assert text.messages == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    )
    assert text.max_tokens == 5 and text.stop == ("\n",) and text.seed == 3
    assert harness.scheduler.released == [None] and harness.scheduler.closed == 1


def test_chat_streaming_with_usage(harness: Harness) -> None:
    stream = client_for(harness).chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello!"
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finishing] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])
    assert harness.scheduler.released == [None] and harness.scheduler.closed == 1


def test_stream_ends_with_done_and_max_completion_tokens_wins(harness: Harness) -> None:
    r = harness.client.post(
        "/v1/chat/completions",
        json={
            "model": "smollm2-135m",
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "max_tokens": 9,
            "max_completion_tokens": 4,
        },
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert "usage" not in json.loads(events[1])
    assert harness.scheduler.requests[0][1].max_tokens == 4


@pytest.mark.parametrize("asked", [4097, 16384, 1 << 20, None])
def test_max_tokens_above_the_cap_or_unset_is_the_cap(harness: Harness, asked: int | None) -> None:
    r = harness.client.post(
        "/v1/chat/completions",
        json={
            "model": "smollm2-135m",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": asked,
        },
    )
    assert r.status_code == 200
    assert harness.scheduler.requests[0][1].max_tokens == 4096  # max_tokens_cap


def test_completions_both_ways(harness: Harness) -> None:
    c = client_for(harness)
    out = c.completions.create(model="smollm2-135m", prompt=["Once"], max_tokens=3)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].text == "Hello!"
    assert harness.scheduler.requests[0] == (
        "open",
        TextRequest(kind="completion", prompt="Once", max_tokens=3),
    )
    harness.scheduler.script.finish_reason = "length"
    pieces = list(c.completions.create(model="smollm2-135m", prompt="Once", stream=True))
    assert "".join(p.choices[0].text for p in pieces) == "Hello!"
    assert pieces[-1].choices[0].finish_reason == "length"


def test_default_model_and_keep_alive_reach_the_scheduler(harness: Harness) -> None:
    for keep_alive, expected in (("5m", 300.0), (1, 1.0), (-1, math.inf), (None, None)):
        body = {"messages": [{"role": "user", "content": "x"}], "keep_alive": keep_alive}
        assert harness.client.post("/v1/chat/completions", json=body).status_code == 200
        assert harness.scheduler.uses[-1] == ("smollm2-135m", expected)


@pytest.mark.parametrize(
    ("error", "status", "etype"),
    [
        (
            ContextOverflow("prompt is 2000 tokens; the context is 1024"),
            400,
            "invalid_request_error",
        ),
        (QueueFull("queue full", retry_after=3), 503, "service_unavailable"),
        (
            InsufficientMemory("no room", details={"needed": 5, "available": 1}),
            507,
            "insufficient_memory",
        ),
    ],
)
def test_errors_before_the_first_token_keep_their_status(
    harness: Harness, error: Exception, status: int, etype: str
) -> None:
    harness.scheduler.script.error = error
    harness.scheduler.script.error_after = 0
    for stream in (False, True):
        r = harness.client.post(
            "/v1/chat/completions",
            json={
                "model": "smollm2-135m",
                "messages": [{"role": "user", "content": "x"}],
                "stream": stream,
            },
        )
        assert r.status_code == status, r.text
        assert r.json()["error"]["type"] == etype
    if status == 503:
        assert r.headers["retry-after"] == "3"
    assert harness.scheduler.closed == 2 and len(harness.scheduler.released) == 2


def test_scheduler_refusal_is_a_507_with_numbers(harness: Harness) -> None:
    harness.scheduler.use_error = InsufficientMemory(
        "too big", details={"model": "smollm2-135m", "needed": 9, "available": 1, "limit": 5}
    )
    r = harness.client.post("/v1/completions", json={"model": "smollm2-135m", "prompt": "x"})
    assert r.status_code == 507
    assert r.json()["error"]["needed"] == 9 and r.json()["error"]["limit"] == 5


@pytest.mark.parametrize(
    "error", [RunnerCrashed("runner died: killed by signal SIGKILL"), MemoryPressure("hard")]
)
def test_error_mid_stream_is_the_last_event(harness: Harness, error: Exception) -> None:
    harness.scheduler.script.error = error
    harness.scheduler.script.error_after = 2
    stream = client_for(harness).chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "x"}], stream=True
    )
    got = []
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            got.append(chunk.choices[0].delta.content or "")
    assert "".join(got) == "Hello"
    assert str(error) in str(info.value)
    raw = harness.client.post(
        "/v1/chat/completions",
        json={
            "model": "smollm2-135m",
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
        },
    )
    last = json.loads(sse_events(raw.text)[-1])
    assert last["error"]["type"] == type(error).type
    # The scheduler saw the failure, and the runner's iterator was closed.
    assert isinstance(harness.scheduler.released[-1], type(error))
    assert harness.scheduler.closed == 2


def test_unexpected_exception_is_a_generic_500(harness: Harness) -> None:
    harness.scheduler.script.error = RuntimeError("secret internals")
    harness.scheduler.script.error_after = 0
    r = harness.client.post("/v1/completions", json={"model": "smollm2-135m", "prompt": "x"})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert "secret" not in r.text
