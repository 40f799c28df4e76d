"""The Ollama routes over the scheduler stand-ins: what reaches the runner, the NDJSON
stream, and errors in Ollama's shape with elbowroom's statuses."""

from __future__ import annotations

import json
from typing import Any

import pytest
from server_fakes import Harness, Script

from elbowroom.engines.requests import TextRequest
from elbowroom.errors import BadRequest, InsufficientMemory, RunnerCrashed

HI = [{"role": "user", "content": "Hi"}]


def test_chat_reaches_the_runner_as_a_text_request(harness: Harness) -> None:
    r = harness.client.post(
        "/api/chat",
        json={
            "model": "smollm2-135m:latest",
            "messages": HI,
            "stream": False,
            "format": "json",
            "options": {"temperature": 0, "num_predict": 5, "seed": 1, "num_thread": 4},
            "keep_alive": "1m",
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "smollm2-135m:latest"
    assert body["message"] == {"role": "assistant", "content": "Hello!"}
    assert body["done"] is True and body["done_reason"] == "stop"
    assert body["prompt_eval_count"] == 7 and body["eval_count"] == 3
    assert body["total_duration"] > 0
    kind, text = harness.scheduler.requests[0]
    assert kind == "open" and isinstance(text, TextRequest) and text.kind == "chat"
    assert text.messages == ({"role": "user", "content": "Hi"},)
    assert text.temperature == 0 and text.max_tokens == 5 and text.seed == 1
    assert text.response_format == {"type": "json_object"}
    assert harness.scheduler.uses == [("smollm2-135m", 60.0)]


def test_num_predict_is_clamped_to_the_cap_as_openais_max_tokens(harness: Harness) -> None:
    """No limit (-1), none sent, or more than the cap: every request generates at most
    max_tokens_cap tokens, the same clamp as the OpenAI routes'."""
    for options in ({"num_predict": -1}, {}, {"num_predict": 100_000}, {"num_predict": 7}):
        r = harness.client.post(
            "/api/generate",
            json={"model": "smollm2-135m", "prompt": "Hi", "stream": False, "options": options},
        )
        assert r.status_code == 200, r.text
    caps = [text.max_tokens for _, text in harness.scheduler.requests]
    assert caps == [4096, 4096, 4096, 7]


@pytest.mark.parametrize("path", ["/api/generate", "/api/chat"])
def test_an_absurd_num_predict_is_a_400_as_openais_max_tokens(harness: Harness, path: str) -> None:
    """Above 2**20 tokens a limit is a client bug: the OpenAI routes answer 400, and so does
    Ollama's (it used to clamp it silently to the cap), in Ollama's error shape."""
    body: dict[str, Any] = {"model": "smollm2-135m", "stream": False}
    body.update({"prompt": "Hi"} if path == "/api/generate" else {"messages": HI})
    r = harness.client.post(path, json={**body, "options": {"num_predict": 1 << 30}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert isinstance(error, str) and "num_predict=1073741824 is absurd" in error
    assert "max_tokens_cap" in error
    assert harness.scheduler.requests == []  # refused before any runner was asked


def test_chat_streams_ndjson(harness: Harness) -> None:
    r = harness.client.post("/api/chat", json={"model": "smollm2-135m", "messages": HI})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert [x["message"]["content"] for x in lines[:-1]] == ["Hel", "lo", "!"]
    assert all(x["done"] is False for x in lines[:-1])
    assert lines[-1]["done"] is True and lines[-1]["done_reason"] == "stop"
    assert lines[-1]["eval_count"] == 3
    assert harness.scheduler.closed == 1  # the runner's iterator was closed


def test_generate_templates_the_prompt_unless_raw(harness: Harness) -> None:
    harness.scheduler.script = Script(finish_reason="length")
    r = harness.client.post(
        "/api/generate", json={"model": "smollm2-135m", "prompt": "Hi", "stream": False}
    )
    assert r.json()["response"] == "Hello!" and r.json()["done_reason"] == "length"
    raw = harness.client.post(
        "/api/generate",
        json={"model": "smollm2-135m", "prompt": "1, 2,", "raw": True, "stream": False},
    )
    assert raw.status_code == 200
    kinds = [(p.kind, p.prompt, p.messages) for _, p in harness.scheduler.requests]
    assert kinds == [
        ("chat", "", ({"role": "user", "content": "Hi"},)),
        ("completion", "1, 2,", ()),
    ]


def test_empty_requests_load_and_keep_alive_zero_unloads(harness: Harness) -> None:
    r = harness.client.post("/api/generate", json={"model": "smollm2-135m", "keep_alive": -1})
    assert r.json()["done_reason"] == "load"
    assert harness.scheduler.uses == [("smollm2-135m", float("inf"))]
    harness.scheduler.loaded["smollm2-135m"] = False
    r = harness.client.post(
        "/api/chat", json={"model": "smollm2-135m", "messages": [], "keep_alive": 0}
    )
    assert r.json()["done_reason"] == "unload" and r.json()["message"]["content"] == ""
    assert harness.scheduler.loaded == {}
    # A pinned model stays: the client is told how to unpin it.
    harness.scheduler.loaded["smollm2-135m"] = True
    r = harness.client.post("/api/generate", json={"model": "smollm2-135m", "keep_alive": 0})
    assert r.status_code == 400 and "pinned" in r.json()["error"]


def test_num_ctx_above_the_loaded_context_is_400(harness: Harness, monkeypatch: Any) -> None:
    rows = [{"id": "smollm2-135m", "state": "ready", "n_ctx": 1024, "pinned": False}]
    monkeypatch.setattr(harness.scheduler, "ps", lambda: rows)
    ok = harness.client.post(
        "/api/chat",
        json={
            "model": "smollm2-135m",
            "messages": HI,
            "stream": False,
            "options": {"num_ctx": 1024},
        },
    )
    assert ok.status_code == 200
    r = harness.client.post(
        "/api/chat",
        json={"model": "smollm2-135m", "messages": HI, "options": {"num_ctx": 4096}},
    )
    assert r.status_code == 400
    assert "1024-token context" in r.json()["error"] and "--ctx 4096" in r.json()["error"]


def test_errors_have_ollama_shape_and_elbowroom_statuses(harness: Harness) -> None:
    c = harness.client
    cases: list[tuple[str, str, Any, int, str]] = [
        ("POST", "/api/chat", {"model": "nope", "messages": HI}, 404, "not found"),
        ("POST", "/api/show", {"model": "nope"}, 404, "GET /api/tags"),
        ("POST", "/api/chat", {"model": "whisper-tiny.en", "messages": HI}, 400, "llm model"),
        ("POST", "/api/chat", {"messages": HI}, 400, "model"),
        (
            "POST",
            "/api/chat",
            {"model": "smollm2-135m", "messages": [{"role": "user", "images": ["aGk="]}]},
            400,
            "has no vision",
        ),
        (
            "POST",
            "/api/generate",
            {"model": "smollm2-135m", "prompt": "x", "options": {"tfs_z": 0.9}},
            400,
            "tfs_z",
        ),
        (
            "POST",
            "/api/generate",
            {"model": "smollm2-135m", "keep_alive": "soon"},
            400,
            "keep_alive",
        ),
        ("POST", "/api/pull", {"model": "llama3"}, 400, "not Ollama's library"),
        ("POST", "/api/pull", {"model": "a/b", "quantize": "q4"}, 400, "quantize"),
        ("POST", "/api/create", {"model": "x"}, 501, "elbowroom serve --model"),
        ("DELETE", "/api/delete", {"model": "x"}, 404, "no model 'x' to delete"),
    ]
    for method, path, body, status, words in cases:
        r = c.request(method, path, json=body)
        assert r.status_code == status, (path, body, r.text)
        assert isinstance(r.json()["error"], str) and words in r.json()["error"], r.text
    bad = c.post("/api/chat", content=b"{not json")
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]
    assert harness.scheduler.requests == []


def test_507_keeps_its_numbers_and_503_its_retry_after(harness: Harness) -> None:
    harness.scheduler.use_error = InsufficientMemory(
        "model 'smollm2-135m' needs 2.0 GiB", details={"needed": 2048, "available": 1024}
    )
    r = harness.client.post("/api/chat", json={"model": "smollm2-135m", "messages": HI})
    assert r.status_code == 507
    assert r.json() == {
        "error": "model 'smollm2-135m' needs 2.0 GiB",
        "needed": 2048,
        "available": 1024,
    }
    harness.scheduler.use_error = RunnerCrashed("the runner exited", retry_after=3)
    r = harness.client.post("/api/generate", json={"model": "smollm2-135m", "prompt": "x"})
    assert r.status_code == 503 and r.headers["retry-after"] == "3"


def test_an_error_mid_stream_is_the_last_line(harness: Harness) -> None:
    harness.scheduler.script = Script(error_after=2, error=RunnerCrashed("killed by SIGKILL"))
    r = harness.client.post("/api/generate", json={"model": "smollm2-135m", "prompt": "x"})
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert [x.get("response") for x in lines[:2]] == ["Hel", "lo"]
    assert lines[-1]["error"] == "killed by SIGKILL"


def test_models_ps_version_and_form_encoded_bodies(harness: Harness) -> None:
    c = harness.client
    assert c.get("/api/version").json()["version"].count(".") == 2
    names = [m["name"] for m in c.get("/api/tags").json()["models"]]
    # Ollama's names carry the tag (langchain's validate_model_on_init compares them exactly)
    assert names == ["smollm2-135m:latest"]  # the ASR model is not an Ollama model
    harness.scheduler.loaded["smollm2-135m"] = False
    ps = c.get("/api/ps").json()
    entry = ps["models"][0]
    assert entry["name"] == entry["model"] == "smollm2-135m:latest"
    assert entry["id"] == "smollm2-135m"
    assert entry["size"] == 10 and entry["size_vram"] == 0 and entry["expires_at"]
    assert ps["memory"]["limit"] == 1000
    own = c.get("/api/elbowroom/ps").json()["models"][0]
    assert "name" not in own and own["engine_stats"] == {"kv_cache": {"entries_ram": 1}}
    # `curl -d` sends a form content type; Ollama reads the body as JSON anyway.
    r = c.post(
        "/api/show",
        content=b'{"model": "smollm2-135m"}',
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 200 and r.json()["capabilities"] == ["completion", "tools"]


def test_ollama_requests_are_counted_and_timed(harness: Harness) -> None:
    from elbowroom.server.http.metrics import METRICS

    def count() -> float:
        samples = METRICS.requests.collect()[0].samples
        return sum(
            s.value
            for s in samples
            if s.name.endswith("_total") and s.labels.get("endpoint") == "ollama_chat"
        )

    before = count()
    harness.client.post("/api/chat", json={"model": "smollm2-135m", "messages": HI})
    assert count() == before + 1
    ttft = METRICS.ttft.collect()[0].samples
    assert any(s.labels.get("endpoint") == "ollama_chat" for s in ttft)


def test_embed_options_null_are_unset() -> None:
    """langchain-ollama's OllamaEmbeddings sends every option, null: unset, not a 400
    (issue 21); an option with a value still means nothing for embeddings."""
    from elbowroom.server.ollama.routes import _embed_options

    _embed_options({"mirostat": None, "top_k": None, "temperature": None, "num_ctx": None})
    with pytest.raises(BadRequest, match="no meaning for embeddings"):
        _embed_options({"mirostat": 2})
