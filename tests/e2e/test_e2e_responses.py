"""/v1/responses through a real `elbowroom serve`, the real engine (SmolLM2) and real clients:
the official openai client's ``responses`` API and openai-agents' default model
(``OpenAIResponsesModel``). A continuation by ``previous_response_id`` is served from the KV
cache (``cached_tokens``) in the running engine, after the model was unloaded and loaded
again, and after the server restarted; another API key sees none of it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.responses import Response
from serverproc import ServerFactory, ServerProcess, wait_for

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
KEY, OTHER_KEY = "key-alice", "key-bob"
SYSTEM = "You are the assistant of a hardware store. " + " ".join(
    f"Rule {i}: answer briefly and name the aisle of item {i}." for i in range(12)
)
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("responses-home")


def start(server_factory: ServerFactory, home: Path) -> ServerProcess:
    return server_factory(
        "--ctx", "2048", home=home, api_key=KEY, env={"ELBOWROOM_API_KEYS": OTHER_KEY}
    )


class Live:
    """The module's server: one at a time, on the same home (a test may restart it)."""

    def __init__(self, server_factory: ServerFactory, home: Path) -> None:
        self.factory = server_factory
        self.home = home
        self.server: ServerProcess | None = None

    def get(self) -> ServerProcess:
        if self.server is None or self.server.proc is None or self.server.proc.poll() is not None:
            self.server = start(self.factory, self.home)
        return self.server

    def restart(self) -> ServerProcess:
        self.get().stop()
        return self.get()


@pytest.fixture(scope="module")
def live(server_factory: ServerFactory, home: Path) -> Live:
    return Live(server_factory, home)


@pytest.fixture
def server(live: Live) -> ServerProcess:
    return live.get()


def client(server: ServerProcess, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def cached(out: Response) -> int:
    assert out.usage is not None
    return out.usage.input_tokens_details.cached_tokens


def ask(server: ServerProcess, **kw: Any) -> Response:
    kw.setdefault("max_output_tokens", 8)
    return client(server).responses.create(model=MODEL, temperature=0, **kw)


def test_plain_and_stream(server: ServerProcess) -> None:
    out = ask(server, instructions="Answer in one word.", input="What color is the sky?")
    assert out.status in ("completed", "incomplete") and out.output_text.strip()
    assert out.usage is not None and out.usage.input_tokens > 10
    assert out.usage.output_tokens > 0
    kinds: list[str] = []
    deltas: list[str] = []
    with client(server).responses.stream(
        model=MODEL, input="Say hello.", max_output_tokens=64, temperature=0
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-1] == "response.completed" and final.status == "completed"
    assert "".join(deltas) == final.output_text and final.output_text.strip()
    assert client(server).responses.retrieve(final.id).output_text == final.output_text


def test_function_tool_round_trip(server: ServerProcess) -> None:
    c = client(server)
    first = c.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=64,
        temperature=0,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather", first.output
    call = calls[0]
    assert set(json.loads(call.arguments)) == {"city"}
    answer = c.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=32,
        temperature=0,
    )
    assert answer.output_text.strip() and answer.output[0].type == "message"
    # tool_choice "none" leaves the (emulated) tools out of the prompt: no cache hit here.
    items = c.responses.input_items.list(answer.id).data
    assert [i.type for i in items] == ["function_call_output"]


def test_json_schema_output(server: ServerProcess) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    out = ask(
        server,
        input="Invent a person.",
        max_output_tokens=60,
        text={
            "format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
        },
    )
    person = json.loads(out.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


def test_continuation_hits_the_cache_and_survives_unload_and_restart(
    server: ServerProcess, live: Live
) -> None:
    first = ask(server, instructions=SYSTEM, input="Hammers?")
    assert first.usage is not None and first.usage.input_tokens > 150
    second = ask(server, instructions=SYSTEM, input="Nails?", previous_response_id=first.id)
    # The whole first prompt came from the slot, in whole 64-token blocks.
    assert cached(second) >= first.usage.input_tokens // 64 * 64 > 0
    assert second.previous_response_id == first.id
    # Unloaded: the runner saves its slots into the disk tier, the next one restores them.
    with server.http() as http:
        assert http.post(f"/api/models/{MODEL}/unload").status_code == 200
    wait_for(lambda: server.ps() == [], timeout=60, what="the unload")
    third = ask(server, instructions=SYSTEM, input="Saws?", previous_response_id=second.id)
    assert second.usage is not None
    assert cached(third) >= first.usage.input_tokens // 64 * 64
    # Restarted: the stored response and the disk tier are both still there.
    restarted = live.restart()  # graceful: the runner saves its slots on the way out
    assert client(restarted).responses.retrieve(third.id).output_text == third.output_text
    fourth = ask(restarted, instructions=SYSTEM, input="Glue?", previous_response_id=third.id)
    assert cached(fourth) >= first.usage.input_tokens // 64 * 64
    sent = [m.role for m in client(restarted).responses.input_items.list(fourth.id).data]  # type: ignore[union-attr]
    assert sent == ["user"]


def test_another_key_gets_404(server: ServerProcess) -> None:
    mine = ask(server, input="My secret is 42.", max_output_tokens=4)
    other = client(server, OTHER_KEY)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.input_items.list(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError) as info:
        other.responses.create(model=MODEL, input="And?", previous_response_id=mine.id)
    assert info.value.body["code"] == "response_not_found"  # type: ignore[index]
    assert client(server).responses.retrieve(mine.id).id == mine.id
    with pytest.raises(openai.BadRequestError) as bad:
        client(server).responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
    assert bad.value.body["code"] == "unsupported_tool"  # type: ignore[index]
    client(server).responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        client(server).responses.retrieve(mine.id)


def test_openai_agents_default_model(live: Live) -> None:
    agents = pytest.importorskip("agents", reason="openai-agents is in the dev extra")
    from pydantic import BaseModel

    agents.set_tracing_disabled(True)

    class Person(BaseModel):
        name: str
        age: int

    called: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        called.append(city)
        return f"Sunny, 24 C in {city}"

    def agents_on(server: ServerProcess) -> dict[str, Any]:
        model = agents.OpenAIResponsesModel(
            model=MODEL,
            openai_client=openai.AsyncOpenAI(
                base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120
            ),
        )
        # The SDK takes a response cut by max_tokens for an error: room for whole answers.
        settings = agents.ModelSettings(max_tokens=96, temperature=0)
        return {
            "plain": agents.Agent(
                name="plain", instructions=SYSTEM, model=model, model_settings=settings
            ),
            "tooled": agents.Agent(
                name="weather",
                instructions="Use get_weather to answer.",
                model=model,
                tools=[get_weather],
                model_settings=agents.ModelSettings(
                    max_tokens=48, temperature=0, tool_choice="required"
                ),
                tool_use_behavior="stop_on_first_tool",
            ),
            "answer": agents.Agent(
                name="answer", instructions="Answer in one short sentence.", model=model,
                model_settings=settings,
            ),
            "typed": agents.Agent(
                name="typed", instructions="Invent a person.", model=model, output_type=Person,
                model_settings=settings,
            ),
        }  # fmt: skip

    async def before_restart(a: dict[str, Any]) -> dict[str, Any]:
        run = agents.Runner.run
        out: dict[str, Any] = {}
        # call -> the SDK runs the tool -> its output item -> the model's answer
        call = await run(a["tooled"], "What is the weather in Paris?")
        outputs = [i.to_input_item() for i in call.new_items if i.type == "tool_call_output_item"]
        out["call"], out["outputs"] = call, outputs
        out["answer"] = await run(a["answer"], outputs, previous_response_id=call.last_response_id)
        out["typed"] = await run(a["typed"], "Go.")
        streamed = agents.Runner.run_streamed(a["answer"], "Say hi.")
        async for _ in streamed.stream_events():
            pass
        out["streamed"] = streamed.final_output
        # Last: still in its slot when the server stops, so the disk tier keeps its state
        # (a conversation pushed out of every slot before that is recomputed once).
        out["first"] = await run(a["plain"], "Hammers?")
        return out

    got = asyncio.run(before_restart(agents_on(live.get())))
    first = got["first"]
    assert str(first.final_output).strip()
    assert [i.type for i in got["call"].new_items] == ["tool_call_item", "tool_call_output_item"]
    assert called and got["call"].final_output == f"Sunny, 24 C in {called[0]}"
    assert len(got["outputs"]) == 1 and got["outputs"][0]["type"] == "function_call_output"
    assert str(got["answer"].final_output).strip()
    assert isinstance(got["typed"].final_output, Person) and got["typed"].final_output.name
    assert str(got["streamed"]).strip()

    restarted = agents_on(live.restart())
    more = asyncio.run(
        agents.Runner.run(restarted["plain"], "Nails?", previous_response_id=first.last_response_id)
    )
    assert str(more.final_output).strip()
    usage = more.raw_responses[-1].usage
    assert usage.input_tokens > first.raw_responses[-1].usage.input_tokens
    assert usage.input_tokens_details.cached_tokens >= 128  # the stored turn, from the disk tier
