"""/v1/embeddings' HTTP layer with the scheduler stood in; the real engine is in e2e."""

from __future__ import annotations

import base64
import struct
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, ClassVar

import anyio
import pytest
from server_fakes import http_scope
from starlette.testclient import TestClient

from elbowroom.config import Settings
from elbowroom.engines.requests import EmbedRequest
from elbowroom.errors import ModelNotFound
from elbowroom.models.spec import Holding, ModelKind, ModelSpec
from elbowroom.server.app import create_app
from elbowroom.server.deps import Services
from elbowroom.server.http.metrics import METRICS
from elbowroom.server.openai.embeddings_routes import encode_base64

VECTORS = [[0.6, 0.8, 0.0], [0.1, -0.2, 0.3]]


class Catalog:
    specs: ClassVar[dict[str, ModelSpec]] = {
        s.id: s
        for s in (
            ModelSpec(
                "minilm-l6-v2",
                ModelKind.EMBEDDING,
                "onnx-embed",
                Path("/x"),
                1,
                Holding.RESIDENT,
                "bundled",
            ),
            ModelSpec(
                "smollm2-135m", ModelKind.LLM, "llama", Path("/x"), 1, Holding.MMAP, "bundled"
            ),
        )
    }

    def get(self, model_id: str) -> ModelSpec:
        if model_id not in self.specs:
            raise ModelNotFound(model_id)
        return self.specs[model_id]


class Scheduler:
    def __init__(self) -> None:
        self.calls: list[tuple[str, EmbedRequest]] = []

    @asynccontextmanager
    async def use(self, model_id: str, keep_alive: float | None = None) -> AsyncIterator[Any]:
        yield self

    async def request(self, op: str, payload: EmbedRequest) -> AsyncIterator[dict[str, Any]]:
        self.calls.append((op, payload))
        n = len(payload.inputs)
        yield {"type": "done", "embeddings": VECTORS[:n], "prompt_tokens": 5 * n}


@pytest.fixture
def parts() -> Iterator[tuple[TestClient, Scheduler]]:
    scheduler = Scheduler()
    settings = Settings(max_embedding_inputs=2)
    services = Services(settings=settings, catalog=Catalog(), scheduler=scheduler)
    with TestClient(create_app(settings, services=services), base_url="http://localhost") as client:
        yield client, scheduler


def test_float_and_base64_encodings(parts: tuple[TestClient, Scheduler]) -> None:
    client, scheduler = parts
    body = {"model": "text-embedding-3-small", "input": ["a", "b"]}
    floats = client.post("/v1/embeddings", json=body).json()
    assert [d["embedding"] for d in floats["data"]] == VECTORS
    assert [d["index"] for d in floats["data"]] == [0, 1]
    assert floats["model"] == "minilm-l6-v2"
    assert floats["usage"] == {"prompt_tokens": 10, "total_tokens": 10}
    b64 = client.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    raw = base64.b64decode(b64["data"][1]["embedding"])
    assert struct.unpack("<3f", raw) == pytest.approx(VECTORS[1])
    assert scheduler.calls[0] == ("embed", EmbedRequest(inputs=("a", "b")))


def test_base64_is_little_endian_float32() -> None:
    assert base64.b64decode(encode_base64([1.0])) == b"\x00\x00\x80\x3f"


def test_a_single_string_is_one_input(parts: tuple[TestClient, Scheduler]) -> None:
    r = parts[0].post("/v1/embeddings", json={"model": "minilm-l6-v2", "input": "hello"})
    assert r.status_code == 200 and len(r.json()["data"]) == 1


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"input": []}, 400, "must not be empty"),
        ({"input": ""}, 400, "input[0] is empty"),
        ({"input": ["ok", " "]}, 400, "input[1] is empty"),
        ({"input": ["a", "b", "c"]}, 400, "at most 2"),
        ({"input": [[1, "a"]]}, 400, "list of token ids"),
        ({"input": [1, [2]]}, 400, "not a mix"),
        ({"input": [[]]}, 400, "empty token list"),
        ({"input": [[-1]]}, 400, "list of token ids"),
        ({"input": [[1] * 8193]}, 400, "at most 8192"),
        ({"input": {"text": "x"}}, 400, "string or a list"),
        ({}, 400, "Missing required parameter: 'input'"),
        ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "x", "model": "smollm2-135m"}, 400, "needs a model of kind embedding"),
        ({"input": "x", "model": "nope"}, 404, "does not exist"),
    ],
)
def test_bad_requests_never_reach_a_model(
    parts: tuple[TestClient, Scheduler], body: dict[str, Any], status: int, words: str
) -> None:
    client, scheduler = parts
    r = client.post("/v1/embeddings", json={"model": "minilm-l6-v2", **body})
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]
    assert scheduler.calls == []


def test_dimensions_other_than_the_models_are_refused(
    parts: tuple[TestClient, Scheduler],
) -> None:
    r = parts[0].post("/v1/embeddings", json={"input": "x", "dimensions": 2})
    assert r.status_code == 400 and "3-dimensional" in r.json()["error"]["message"]
    r = parts[0].post("/v1/embeddings", json={"input": "x", "dimensions": 3})
    assert r.status_code == 200


# --- the metric's model label: recorded by the route, never read from the body ---------------


def requests_total(model: str, status: str) -> float:
    labels = {"endpoint": "embeddings", "model": model, "status": status}
    return METRICS.registry.get_sample_value("elbowroom_requests_total", labels) or 0.0


def test_the_model_label_is_the_model_the_route_resolved(
    parts: tuple[TestClient, Scheduler],
) -> None:
    before = requests_total("minilm-l6-v2", "200")
    r = parts[0].post("/v1/embeddings", json={"model": "text-embedding-3-small", "input": "x"})
    assert r.status_code == 200
    # The alias is labelled with the catalog id it resolved to, as the route saw it.
    assert requests_total("minilm-l6-v2", "200") == before + 1
    assert requests_total("text-embedding-3-small", "200") == 0


def test_a_model_the_route_rejects_leaves_no_new_label(
    parts: tuple[TestClient, Scheduler],
) -> None:
    client = parts[0]
    unlabelled = {s: requests_total("-", s) for s in ("400", "404")}
    wrong_kind = requests_total("smollm2-135m", "400")
    named = requests_total("minilm-l6-v2", "400")  # a 400 after the route took the model
    # A catalog LLM on the embeddings route (400), a name the catalog lacks (404), bad
    # inputs before any model is resolved (400), a body that is not JSON (400, no route).
    assert client.post("/v1/embeddings", json={"model": "smollm2-135m", "input": "x"}).is_error
    assert client.post("/v1/embeddings", json={"model": "no-such-label", "input": "x"}).is_error
    assert client.post("/v1/embeddings", json={"model": "minilm-l6-v2", "input": ""}).is_error
    r = client.post(
        "/v1/embeddings",
        content=b'{"model": "minilm-l6-v2", "input": ',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert requests_total("-", "400") == unlabelled["400"] + 3
    assert requests_total("-", "404") == unlabelled["404"] + 1
    assert requests_total("smollm2-135m", "400") == wrong_kind
    assert requests_total("minilm-l6-v2", "400") == named
    assert requests_total("no-such-label", "404") == 0


def test_token_ids_for_an_openai_name_are_decoded_with_cl100k(
    parts: tuple[TestClient, Scheduler],
) -> None:
    """LangChain's OpenAIEmbeddings() sends tiktoken ids ([[15339, 1917]] is "hello world"
    in cl100k_base): for an OpenAI model name the engine gets the text (a 400 before)."""
    client, scheduler = parts
    r = client.post(
        "/v1/embeddings",
        json={"model": "text-embedding-ada-002", "input": [[15339, 1917], [9906, 0]]},
    )
    assert r.status_code == 200, r.text
    assert scheduler.calls[-1] == ("embed", EmbedRequest(inputs=("hello world", "Hello!")))
    r = client.post("/v1/embeddings", json={"input": [15339, 1917, 100257]})
    assert scheduler.calls[-1][1].inputs == ("hello world<|endoftext|>",)
    r = client.post("/v1/embeddings", json={"input": [[100300]]})
    assert r.status_code == 400 and "cl100k_base" in r.json()["error"]["message"]


def test_token_ids_for_a_model_by_name_are_the_models_own(
    parts: tuple[TestClient, Scheduler],
) -> None:
    """A model named directly gets its own tokenizer's ids: the engine decodes them."""
    client, scheduler = parts
    r = client.post("/v1/embeddings", json={"model": "minilm-l6-v2", "input": [[7592, 2088]]})
    assert r.status_code == 200, r.text
    assert scheduler.calls[-1] == ("embed", EmbedRequest(inputs=((7592, 2088),)))


class _Hanging(Scheduler):
    """An embedding batch that runs until its request is closed (what cancels it in the
    worker, between batches)."""

    def __init__(self) -> None:
        super().__init__()
        self.closed: list[str] = []

    async def request(self, op: str, payload: EmbedRequest) -> AsyncIterator[dict[str, Any]]:
        self.calls.append((op, payload))
        try:
            await anyio.sleep(3600)
            yield {"type": "done", "embeddings": [], "prompt_tokens": 0}
        finally:
            self.closed.append(op)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/embeddings", b'{"model": "minilm-l6-v2", "input": ["a", "b"]}'),
        ("/api/embed", b'{"model": "minilm-l6-v2", "input": ["a", "b"]}'),
    ],
)
def test_a_client_that_leaves_stops_the_batch(path: str, body: bytes) -> None:
    """Before: the batch ran to its end for nobody (the route never noticed the client)."""
    scheduler = _Hanging()
    settings = Settings(max_embedding_inputs=2)
    app = create_app(
        settings, services=Services(settings=settings, catalog=Catalog(), scheduler=scheduler)
    )
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop()
        while not scheduler.calls:
            await anyio.sleep(0.01)
        return {"type": "http.disconnect"}  # the client leaves while the batch runs

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = http_scope(
        path,
        [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"host", b"localhost"),
        ],
    )

    async def run() -> None:
        with anyio.fail_after(30):  # only the disconnect can end this call
            await app(scope, receive, send)

    anyio.run(run)
    assert scheduler.closed == ["embed"]


class _NoSecondParse:
    """Starlette's ``json`` while the test runs: the route must not parse the body again."""

    @staticmethod
    def loads(*args: Any, **kw: Any) -> Any:
        raise AssertionError("the body was parsed a second time")


@pytest.mark.parametrize(
    ("path", "content_type"),
    [
        ("/v1/embeddings", "application/json"),
        ("/api/embed", "application/json"),
        ("/api/embed", "application/x-www-form-urlencoded"),  # Ollama: any type is JSON
    ],
)
def test_the_body_gates_parse_is_the_routes(
    parts: tuple[TestClient, Scheduler],
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    content_type: str,
) -> None:
    """JSON parsed once: FastAPI parsed the body again, on the event loop, after the gate."""
    import starlette.requests

    client, scheduler = parts
    monkeypatch.setattr(starlette.requests, "json", _NoSecondParse)
    body = b'{"model": "minilm-l6-v2", "input": ["a", "b"]}'
    r = client.post(path, content=body, headers={"content-type": content_type})
    assert r.status_code == 200, r.text
    assert scheduler.calls[-1] == ("embed", EmbedRequest(inputs=("a", "b")))
