"""The Ollama API through the official ``ollama`` Python client against a real server:
list, show, ps, version, chat and generate (streaming and not, format, tools), embed,
embeddings, keep_alive=0 unloading, and errors in Ollama's shape."""

from __future__ import annotations

import json
from typing import Any

import httpx
import ollama
import pytest
from serverproc import ServerFactory, ServerProcess, wait_for

pytestmark = pytest.mark.slow

LLM = "smollm2-135m"
EMBED = "minilm-l6-v2"
HI = [{"role": "user", "content": "Say hello."}]
GREEDY = {"temperature": 0, "num_predict": 6, "seed": 1}  # few tokens: 2 cores are shared


@pytest.fixture(scope="module")
def server(server_factory: ServerFactory) -> ServerProcess:
    return server_factory("--ctx", "1024", "--slots", "2")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=180)


def bare(name: object) -> str:
    """A model's name without the ``:latest`` tag that /api/tags and /api/ps add."""
    return str(name).removesuffix(":latest")


def loaded(client: ollama.Client) -> list[str]:
    return [bare(m.model) for m in client.ps().models]


def test_list_show_version(client: ollama.Client, server: ServerProcess) -> None:
    names = [m.model for m in client.list().models]
    assert LLM + ":latest" in names and EMBED + ":latest" in names
    assert "whisper-tiny.en" not in names  # not something the Ollama API can run
    tag = next(m for m in client.list().models if bare(m.model) == LLM)
    assert tag.size and tag.size > 10_000_000 and tag.details and tag.details.format == "gguf"
    shown = client.show(LLM + ":latest")
    assert shown.capabilities == ["completion", "tools"]
    assert shown.modelinfo and shown.modelinfo["llama.context_length"] == 8192
    assert shown.details and shown.details.family == "llama"
    version = httpx.get(server.url + "/api/version").json()["version"]
    assert [int(p) for p in version.split(".")] >= [0, 5, 0]


def test_chat_generate_and_streaming(client: ollama.Client) -> None:
    out = client.chat(model=LLM, messages=HI, options=GREEDY)
    assert out.done and out.done_reason in ("stop", "length")
    assert out.message.role == "assistant" and out.message.content
    assert out.eval_count and 0 < out.eval_count <= 6 and out.prompt_eval_count
    assert out.total_duration and out.eval_duration
    # Greedy is deterministic: the stream says the same, piece by piece.
    pieces = list(client.chat(model=LLM, messages=HI, options=GREEDY, stream=True))
    assert len(pieces) > 2 and pieces[-1].done and not any(p.done for p in pieces[:-1])
    assert "".join(p.message.content or "" for p in pieces) == out.message.content

    streamed = list(
        client.generate(model=LLM, prompt="The capital of France is", options=GREEDY, stream=True)
    )
    assert streamed[-1].done and "".join(p.response or "" for p in streamed)
    raw = client.generate(model=LLM, prompt="1, 2, 3, 4,", raw=True, options=GREEDY)
    assert raw.response and raw.done and not isinstance(raw, list)

    limited = client.generate(model=LLM, prompt="Count to 100:", options={"num_predict": 3})
    assert limited.done_reason == "length" and limited.eval_count == 3


def test_format_and_tools(client: ollama.Client) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
    }
    out = client.chat(
        model=LLM,
        messages=[{"role": "user", "content": "Weather in Paris as JSON."}],
        format=schema,
        options={"temperature": 0, "num_predict": 40},
    )
    data = json.loads(out.message.content or "")
    assert isinstance(data["city"], str) and isinstance(data["sunny"], bool)

    def get_weather(city: str) -> str:
        """Get the weather in a city.

        Args:
          city: the city
        """
        return "sunny"

    out = client.chat(
        model=LLM,
        messages=[{"role": "user", "content": "What is the weather in Paris? Use the tool."}],
        tools=[get_weather],
        options={"temperature": 0, "num_predict": 40},
    )
    calls = out.message.tool_calls or []
    # SmolLM2's template has no tools: elbowroom emulates them, and a call comes back with
    # its arguments as an object (Ollama's shape), or the model answered in text.
    assert calls or out.message.content
    for call in calls:
        assert call.function.name == "get_weather"
        assert isinstance(call.function.arguments, dict)


def test_embed_and_embeddings(client: ollama.Client) -> None:
    out = client.embed(model=EMBED, input=["a cat", "a dog"])
    assert len(out.embeddings) == 2 and len(out.embeddings[0]) == 384
    assert out.prompt_eval_count and out.prompt_eval_count > 0
    single = client.embeddings(model=EMBED, prompt="a cat")
    assert single.embedding == pytest.approx(out.embeddings[0], abs=1e-5)


def test_ps_and_keep_alive_zero_unloads(client: ollama.Client, server: ServerProcess) -> None:
    client.generate(model=LLM, prompt="Hi", options={"num_predict": 2})
    client.embed(model=EMBED, input="x")
    ps = {bare(m.model): m for m in client.ps().models}
    llm = ps[LLM]
    assert llm.size and llm.size > 50_000_000 and llm.size_vram == 0
    assert llm.context_length == 1024 and llm.expires_at is not None
    assert llm.details and llm.details.quantization_level
    row: dict[str, Any] = next(r for r in server.ps() if r["id"] == LLM)
    # size is the measured bytes (measured again a moment later here: within a few %).
    assert row["state"] == "ready"
    assert llm.size == pytest.approx(row["bytes"] + row["gpu"], rel=0.05)

    # keep_alive=0 on a request: served, then unloaded.
    client.embed(model=EMBED, input="bye", keep_alive=0)
    wait_for(lambda: EMBED not in loaded(client), timeout=30, what="MiniLM to unload")
    # A request with no prompt and keep_alive=0 is Ollama's "unload now" (`ollama stop`).
    out = client.generate(model=LLM, keep_alive=0)
    assert out.done_reason == "unload"
    wait_for(lambda: LLM not in loaded(client), timeout=30, what="SmolLM2 to unload")
    # No prompt and a keep_alive: load it and keep it for that long.
    assert client.generate(model=LLM, keep_alive="10m").done_reason == "load"
    assert LLM in loaded(client)


def test_errors_in_ollama_shape(client: ollama.Client, server: ServerProcess) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="llama3.2", messages=HI)
    assert info.value.status_code == 404 and "GET /api/tags" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.pull("llama3.2")
    assert info.value.status_code == 400 and "not Ollama's library" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model=LLM, messages=[{"role": "user", "content": "?", "images": [b"\x89PNG"]}])
    assert info.value.status_code == 400 and "images" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.embed(model=LLM, input="x")
    assert info.value.status_code == 400
    r = httpx.post(server.url + "/api/generate", content=b'{"model": ', timeout=30)
    assert r.status_code == 400 and isinstance(r.json()["error"], str)


def test_num_ctx_above_the_loaded_context_reloads_the_model_at_it(
    client: ollama.Client, server: ServerProcess
) -> None:
    client.chat(model=LLM, messages=HI, options=GREEDY)
    before = next(m for m in client.ps().models if m.name == LLM + ":latest")
    assert before.context_length == 1024  # --ctx 1024
    pid = next(r["pid"] for r in server.ps() if r["id"] == LLM)
    # Below the loaded context: it runs as loaded.
    client.chat(model=LLM, messages=HI, options={**GREEDY, "num_ctx": 512})
    assert next(r["pid"] for r in server.ps() if r["id"] == LLM) == pid
    out = client.chat(model=LLM, messages=HI, options={**GREEDY, "num_ctx": 2048})
    assert out.done and out.message.content
    after = next(m for m in client.ps().models if m.name == LLM + ":latest")
    assert after.context_length == 2048
    row = next(r for r in server.ps() if r["id"] == LLM)
    assert row["n_ctx"] == 2048 and row["pid"] != pid  # a new runner, at the asked context


def test_num_ctx_that_cannot_fit_is_a_507_in_ollama_shape(server_factory: ServerFactory) -> None:
    # 4 slots: 1024 tokens each fit this budget; 8192 each (~0.75 GiB of f16 KV) do not.
    limited = server_factory(
        "--ctx",
        "1024",
        "--slots",
        "4",
        env={
            "ELBOWROOM_KV_RAM_MAX": "0",
            "ELBOWROOM_OVERRIDE_MEMORY": str(1536 * 2**20),
            "ELBOWROOM_CONTAINER_MARGIN": str(512 * 2**20),
        },
    )
    client = ollama.Client(host=limited.url, timeout=180)
    assert client.chat(model=LLM, messages=HI, options=GREEDY).done
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model=LLM, messages=HI, options={**GREEDY, "num_ctx": 8192})
    assert info.value.status_code == 507 and LLM in info.value.error
    assert [(r["id"], r["n_ctx"]) for r in limited.ps()] == [(LLM, 1024)]  # left as it was
    assert client.chat(model=LLM, messages=HI, options=GREEDY).done


def test_ps_watch_draws_the_dashboard_in_the_terminal(
    client: ollama.Client, server: ServerProcess
) -> None:
    client.embed(model=EMBED, input="x")
    table = server.cli("ps", "--watch", "--count", "2", "--interval", "0.2")
    assert table.returncode == 0, table.stderr
    for words in ("memory pools", "loaded models", EMBED, "recent events", "load"):
        assert words in table.stdout, (words, table.stdout)
    lines = server.cli("ps", "--watch", "--json", "--count", "2", "--interval", "0.2")
    docs = [json.loads(line) for line in lines.stdout.splitlines()]
    assert len(docs) == 2 and all(d["pools"][0]["id"] == "memory" for d in docs)
    assert EMBED in [m["id"] for m in docs[-1]["models"]]
