"""/v1/responses over the HTTP layer's fakes (server_fakes.py), through the official openai
client: every answer, stream event and stored object is parsed by ``openai.types.responses``
models, every refusal is checked for OpenAI's error shape and status."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from server_fakes import Harness, http_scope, services
from starlette.testclient import TestClient

from elbowroom.config import Settings
from elbowroom.engines.requests import TextRequest
from elbowroom.errors import InsufficientMemory, MemoryPressure, QueueFull
from elbowroom.server.app import create_app

MODEL = "smollm2-135m"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
EVENTS: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)


@pytest.fixture
def h(make_harness: Callable[..., Harness], tmp_path: Path) -> Harness:
    return make_harness(data_dir=tmp_path)


def client(h: Harness, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://localhost/v1", api_key=key, http_client=h.client, max_retries=0
    )


def sent(h: Harness, i: int = -1) -> TextRequest:
    request = h.scheduler.requests[i][1]
    assert isinstance(request, TextRequest)
    return request


def events(raw: str) -> list[Any]:
    """Every event of a raw Responses stream, parsed by the SDK's own union; the ``event:``
    line names each one's type."""
    out = []
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        name, data = block.split("\n", 1)
        event = EVENTS.validate_python(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {event.type}"
        out.append(event)
    assert [e.sequence_number for e in out] == list(range(len(out)))
    return out


def test_plain_answer_is_a_response_object(h: Harness) -> None:
    out = client(h).responses.create(
        model=MODEL, instructions="Be brief.", input="Hi", max_output_tokens=9, temperature=0.5
    )
    Response.model_validate(out.model_dump())
    assert out.output_text == "Hello!" and out.status == "completed"
    assert out.instructions == "Be brief." and out.max_output_tokens == 9
    assert out.usage is not None
    assert (out.usage.input_tokens, out.usage.output_tokens, out.usage.total_tokens) == (7, 3, 10)
    assert out.usage.input_tokens_details.cached_tokens == 2
    text = sent(h)
    assert text.kind == "chat" and text.max_tokens == 9 and text.temperature == 0.5
    assert list(text.messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]


def test_length_is_incomplete(h: Harness) -> None:
    h.scheduler.script.finish_reason = "length"
    out = client(h).responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    assert out.status == "incomplete"
    assert out.incomplete_details is not None
    assert out.incomplete_details.reason == "max_output_tokens"


def test_stream_events_parse_and_add_up(h: Harness) -> None:
    r = h.client.post("/v1/responses", json={"model": MODEL, "input": "Hi", "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    got = events(r.text)
    kinds = [e.type for e in got]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = "".join(e.delta for e in got if e.type == "response.output_text.delta")
    final = got[-1].response
    assert deltas == "Hello!" == final.output_text
    assert final.usage.input_tokens == 7 and final.usage.input_tokens_details.cached_tokens == 2
    # The SDK's stream helper assembles the same answer.
    with client(h).responses.stream(model=MODEL, input="Hi") as stream:
        assert stream.get_final_response().output_text == "Hello!"


def test_function_call_round_trip(h: Harness) -> None:
    script = h.scheduler.script
    script.pieces = ()
    script.finish_reason = "tool_calls"
    script.done_extra = {"tool_calls": [CALL]}
    c = client(h)
    first = c.responses.create(
        model=MODEL,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",  # type: ignore[list-item]
    )
    (call,) = first.output
    assert call.type == "function_call" and call.status == "completed"
    assert (call.call_id, call.name, json.loads(call.arguments)) == (
        "call_1",
        "get_weather",
        {"city": "Paris"},
    )
    text = sent(h)
    assert text.tool_choice == "required"
    assert text.tools == (
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather of a city",
                "parameters": WEATHER["parameters"],
            },
        },
    )
    script.done_extra = {}
    script.pieces = ("Sunny.",)
    script.finish_reason = "stop"
    answer = c.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": "call_1", "output": "sunny, 24 C"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
    )
    assert answer.output_text == "Sunny." and answer.previous_response_id == first.id
    again = sent(h)
    assert again.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert list(again.messages) == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "sunny, 24 C", "tool_call_id": "call_1"},
    ]


def test_streamed_function_call_events(h: Harness) -> None:
    script = h.scheduler.script
    script.pieces = ()
    script.finish_reason = "tool_calls"
    script.deltas = (
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
    )  # fmt: skip
    body = {"model": MODEL, "input": "Weather?", "tools": [WEATHER], "stream": True}
    got = events(h.client.post("/v1/responses", json=body).text)
    assert [e.type for e in got][2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = got[-3]
    assert done.arguments == '{"city": "Paris"}' and done.item_id == got[2].item.id
    (item,) = got[-1].response.output
    assert (item.type, item.call_id, item.name) == ("function_call", "call_1", "get_weather")


def test_input_items_become_chat_messages(h: Harness) -> None:
    items = [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "b", "annotations": []}],
        },
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [
            {"type": "input_text", "text": "two"}]},
    ]  # fmt: skip
    r = h.client.post("/v1/responses", json={"model": MODEL, "input": items})
    assert r.status_code == 200, r.text
    calls = [
        {"id": c, "type": "function", "function": {"name": n, "arguments": "{}"}}
        for c, n in (("c1", "f"), ("c2", "g"))
    ]
    assert list(sent(h).messages) == [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "tool_calls": calls},
        {"role": "tool", "content": "one", "tool_call_id": "c1"},
        {"role": "tool", "content": "two", "tool_call_id": "c2"},
    ]
    listed = client(h).responses.input_items.list(r.json()["id"], order="asc")
    assert [i.type for i in listed.data] == [
        "message",
        "message",
        "message",
        "function_call",
        "function_call",
        "function_call_output",
        "function_call_output",
    ]
    assert listed.data[2].id == "msg_1"


def test_json_schema_format(h: Harness) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    h.scheduler.script.pieces = ('{"a": 1}',)
    out = client(h).responses.create(
        model=MODEL,
        input="a?",
        text={"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}},
    )
    assert json.loads(out.output_text) == {"a": 1}
    assert out.text is not None and out.text.format is not None
    assert out.text.format.type == "json_schema"
    assert sent(h).response_format == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": schema, "strict": True},
    }


def test_continuation_sends_the_stored_conversation(h: Harness) -> None:
    c = client(h)
    first = c.responses.create(model=MODEL, instructions="Old rules.", input="one")
    h.scheduler.script.pieces = ("second",)
    second = c.responses.create(model=MODEL, previous_response_id=first.id, input="two")
    h.scheduler.script.pieces = ("third",)
    c.responses.create(
        model=MODEL, instructions="New rules.", previous_response_id=second.id, input="three"
    )
    # OpenAI's rule: a continuation's instructions replace the earlier ones.
    assert list(sent(h).messages) == [
        {"role": "system", "content": "New rules."},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "second"},
        {"role": "user", "content": "three"},
    ]
    got = c.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == "second"
    assert [i.id for i in c.responses.input_items.list(second.id).data] == [
        i.id for i in c.responses.input_items.list(second.id, order="desc").data
    ]


def test_stored_stream_can_be_continued(h: Harness) -> None:
    r = h.client.post("/v1/responses", json={"model": MODEL, "input": "Hi", "stream": True})
    final = events(r.text)[-1].response
    got = client(h).responses.retrieve(final.id)
    assert got.output_text == "Hello!" and got.status == "completed"


def test_store_false_is_not_stored(h: Harness) -> None:
    c = client(h)
    out = c.responses.create(model=MODEL, input="Hi", store=False)
    assert out.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(out.id)
    with pytest.raises(openai.NotFoundError) as info:
        c.responses.create(model=MODEL, input="more", previous_response_id=out.id)
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert info.value.body["code"] == "response_not_found"  # type: ignore[index]


def test_delete_and_input_item_pages(h: Harness) -> None:
    c = client(h)
    items = [{"role": "user", "content": str(i)} for i in range(5)]
    out = c.responses.create(model=MODEL, input=items)  # type: ignore[arg-type]
    page = c.responses.input_items.list(out.id, limit=2, order="asc")
    assert page.has_more and len(page.data) == 2
    rest = c.responses.input_items.list(out.id, limit=10, order="asc", after=page.data[-1].id)
    texts = [i.content[0].text for i in page.data + rest.data]  # type: ignore[union-attr]
    assert texts == ["0", "1", "2", "3", "4"] and not rest.has_more
    assert c.responses.delete(out.id) is None
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(out.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.delete(out.id)


def test_another_key_sees_404(make_harness: Callable[..., Harness], tmp_path: Path) -> None:
    h = make_harness(data_dir=tmp_path, api_keys=("key-a", "key-b"))
    a, b = client(h, "key-a"), client(h, "key-b")
    out = a.responses.create(model=MODEL, input="secret")
    assert a.responses.retrieve(out.id).id == out.id
    for call in (
        lambda: b.responses.retrieve(out.id),
        lambda: b.responses.input_items.list(out.id),
        lambda: b.responses.delete(out.id),
        lambda: b.responses.create(model=MODEL, input="x", previous_response_id=out.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert a.responses.retrieve(out.id).id == out.id  # b's delete deleted nothing
    with pytest.raises(openai.AuthenticationError):
        client(h, "nobody").responses.retrieve(out.id)
    # The owner is a keyed hash, never the key itself.
    assert not any(b"key-a" in p.read_bytes() for p in (tmp_path / "responses").iterdir())


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type"),
        ({"tools": [{"type": "computer_use_preview"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "name": "f", "bogus": 1}]}, "tools[0].bogus"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
        ({"frequency_penalty": 1}, "frequency_penalty"),
        ({"input": []}, "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"role": "system", "content": [{"type": "input_image",
                                                    "image_url": "data:,"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"role": "user", "content": 3}]}, "input[0].content"),
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
         "input"),
        ({"temperature": 3}, "temperature"),
        ({"model": "whisper-tiny.en"}, "model"),
    ],
)  # fmt: skip
def test_unsupported_is_a_400(h: Harness, body: dict[str, Any], param: str) -> None:
    r = h.client.post("/v1/responses", json={"model": MODEL, "input": "x", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert h.scheduler.requests == []


def test_unknown_model_is_404(h: Harness) -> None:
    r = h.client.post("/v1/responses", json={"model": "nope", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_too_many_messages_is_413(make_harness: Callable[..., Harness], tmp_path: Path) -> None:
    h = make_harness(data_dir=tmp_path, max_messages=3)
    c = client(h)
    first = c.responses.create(model=MODEL, input="one")
    with pytest.raises(openai.APIStatusError) as info:
        # The stored two and these two: over max_messages.
        c.responses.create(
            model=MODEL,
            previous_response_id=first.id,
            input=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
        )
    assert info.value.status_code == 413
    assert info.value.body["code"] == "too_many_messages"  # type: ignore[index]


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (InsufficientMemory("no room", details={"needed": 9, "limit": 5}), 507),
        (QueueFull("queue full", retry_after=3), 503),
    ],
)
def test_memory_refusals_keep_their_status(h: Harness, error: Exception, status: int) -> None:
    h.scheduler.use_error = error  # type: ignore[assignment]
    for stream in (False, True):
        r = h.client.post("/v1/responses", json={"model": MODEL, "input": "x", "stream": stream})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["type"] == type(error).type and err["message"]
    with pytest.raises(openai.APIStatusError) as info:
        client(h).responses.create(model=MODEL, input="x")
    assert info.value.status_code == status


def test_error_mid_stream_is_an_error_event(h: Harness) -> None:
    h.scheduler.script.error = MemoryPressure("hard", code="memory_pressure")
    h.scheduler.script.error_after = 2
    r = h.client.post("/v1/responses", json={"model": MODEL, "input": "x", "stream": True})
    got = events(r.text)
    assert [e.type for e in got][-2:] == ["error", "response.failed"]
    assert got[-2].code == "memory_pressure" and got[-2].message == "hard"
    assert got[-1].response.status == "failed"
    assert "".join(e.delta for e in got if e.type == "response.output_text.delta") == "Hello"
    assert isinstance(h.scheduler.released[-1], MemoryPressure)
    # A failed response is not stored.
    with pytest.raises(openai.NotFoundError):
        client(h).responses.retrieve(got[0].response.id)


def test_metrics_count_responses(h: Harness) -> None:
    client(h).responses.create(model=MODEL, input="Hi")
    text = h.client.get("/metrics").text
    line = next(
        (ln for ln in text.splitlines() if ln.startswith("elbowroom_requests_total{")
         and 'endpoint="responses"' in ln and 'status="200"' in ln),
        None,
    )  # fmt: skip
    assert line is not None and f'model="{MODEL}"' in line, text


def test_client_leaving_mid_stream_cancels_and_stores_nothing(tmp_path: Path) -> None:
    svc, scheduler = services(Settings(data_dir=tmp_path))
    scheduler.script.hang_after_first = True
    app = create_app(svc.settings, services=svc)
    body = json.dumps({"model": MODEL, "input": "x", "stream": True}).encode()
    first_token = asyncio.Event()
    sent: list[dict[str, Any]] = []
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop()
        await first_token.wait()  # the client leaves once it has seen a token
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if b'"delta":"Hel"' in message.get("body", b""):
            first_token.set()

    scope = http_scope(
        "/v1/responses", [(b"content-type", b"application/json"), (b"host", b"localhost")]
    )

    async def run() -> None:
        # The runner hangs after its first piece: only the disconnect can end this call.
        await asyncio.wait_for(app(scope, receive, send), timeout=30)

    asyncio.run(run())
    assert sent[0]["status"] == 200 and first_token.is_set()
    assert scheduler.closed == 1  # the runner's iterator was closed (generation cancelled)
    assert scheduler.released == [None]  # and the model handed back as a normal release
    assert not list((tmp_path / "responses").glob("resp_*.json"))


def test_the_body_limits_and_origin_rules_apply(
    make_harness: Callable[..., Harness], tmp_path: Path
) -> None:
    h = make_harness(data_dir=tmp_path, max_chars=100)
    r = h.client.post("/v1/responses", json={"model": MODEL, "input": "x" * 200})
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_characters"
    r = h.client.post(
        "/v1/responses",
        json={"model": MODEL, "input": "x"},
        headers={"Origin": "https://evil.example"},
    )
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    r = h.client.post("/v1/responses", content=b"input=x", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    assert h.scheduler.requests == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
         "tool_choice"),
        ({"max_output_tokens": 1 << 30}, "max_output_tokens"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "name": "bad name!", "schema": {}}}},
         "text.format.name"),
    ],
)  # fmt: skip
def test_chat_rules_name_the_responses_field(h: Harness, body: dict[str, Any], param: str) -> None:
    r = h.client.post("/v1/responses", json={"model": MODEL, "input": "x", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_input_image_reaches_a_vision_model(tmp_path: Path) -> None:
    import base64
    import dataclasses
    import io

    from PIL import Image
    from vision_gguf import write_projector

    from elbowroom.models.vision import read_projector

    svc, scheduler = services(Settings(data_dir=tmp_path))
    catalog: Any = svc.catalog
    text_only = catalog.get(MODEL)
    png = io.BytesIO()
    Image.new("RGB", (32, 24), (10, 200, 30)).save(png, "PNG")
    image = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    item = {
        "role": "user",
        "content": [
            {"type": "input_text", "text": "What is this?"},
            {"type": "input_image", "image_url": image, "detail": "low"},
        ],
    }
    with TestClient(create_app(svc.settings, services=svc), base_url="http://localhost") as http:
        r = http.post("/v1/responses", json={"model": MODEL, "input": [item]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "input" and err["code"] == "model_not_supported"
        assert "messages[0].content[1].type" in err["message"]
        proj = read_projector(write_projector(tmp_path / "mmproj-t.gguf"))
        catalog._specs[MODEL] = dataclasses.replace(text_only, projector=proj)
        r = http.post("/v1/responses", json={"model": MODEL, "input": [item]})
        assert r.status_code == 200, r.text
    ((_, text),) = scheduler.requests
    assert isinstance(text, TextRequest)
    (message,) = text.messages
    assert message["content"][0] == {"type": "text", "text": "What is this?"}
    assert message["content"][1]["type"] == "image_url"
    assert message["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")


def test_get_refuses_what_it_cannot_do(h: Harness) -> None:
    out = client(h).responses.create(model=MODEL, input="Hi")
    for query in ("stream=true", "include=file_search_call.results"):
        r = h.client.get(f"/v1/responses/{out.id}?{query}")
        assert r.status_code == 400 and r.json()["error"]["param"] == query.split("=")[0]
    r = h.client.get(f"/v1/responses/{out.id}/input_items?order=sideways")
    assert r.status_code == 400 and r.json()["error"]["param"] == "order"
    r = h.client.get(f"/v1/responses/{out.id}/input_items?after=msg_nope")
    assert r.status_code == 400 and r.json()["error"]["param"] == "after"
    assert h.client.get(f"/v1/responses/{out.id}?stream=false").status_code == 200
