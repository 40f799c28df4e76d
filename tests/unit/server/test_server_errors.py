"""Bad input gets one 400/404 in OpenAI's error shape naming the param; nothing reaches
the scheduler; the server keeps serving."""

from __future__ import annotations

from typing import Any

import pytest
from server_fakes import Harness

USER = [{"role": "user", "content": "hi"}]


def chat(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "smollm2-135m", "messages": USER}
    body.update(overrides)
    return body


def assert_openai_error(r: Any, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err
    return dict(err)


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        (chat(messages=[]), "messages", "at least 1"),
        (chat(messages="hello"), "messages", ""),
        (chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role", ""),
        (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", ""),
        (
            chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "messages[0].content[0]",
            "needs the field 'image_url'",
        ),
        (chat(n=2), "n", "n=1"),
        (chat(max_tokens=-5), "max_tokens", "greater than or equal to 1"),
        (chat(max_tokens=0), "max_tokens", ""),
        (chat(max_tokens="ten"), "max_tokens", "integer"),
        (chat(max_tokens=2_000_000), "max_tokens", "absurd"),
        (chat(max_completion_tokens=1_048_577), "max_completion_tokens", "at most 4096"),
        (chat(temperature=3), "temperature", ""),
        (chat(temperature="hot"), "temperature", ""),
        (chat(top_p=1.5), "top_p", ""),
        (chat(stop=["a", "b", "c", "d", "e"]), "stop", ""),
        (chat(stream="yes"), "stream", ""),
        (chat(model=42), "model", ""),
        (chat(model=""), "model", "empty"),
        (chat(keep_alive="soon"), "keep_alive", "duration"),
        (chat(keep_alive=True), "keep_alive", ""),
        (chat(stream_options={"include_usage": "yes"}), "stream_options.include_usage", ""),
        (chat(model="whisper-tiny.en"), "model", "llm"),
        ({"messages": USER, "model": "smollm2-135m", "seed": 1.5}, "seed", ""),
    ],
)
def test_bad_chat_params(harness: Harness, body: Any, param: str, fragment: str) -> None:
    r = harness.client.post("/v1/chat/completions", json=body)
    err = assert_openai_error(r, 400, param)
    assert err["type"] == "invalid_request_error"
    assert fragment in err["message"]
    assert harness.scheduler.requests == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "smollm2-135m"}, "prompt"),
        ({"model": "smollm2-135m", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "smollm2-135m", "prompt": [1, 2, 3]}, "prompt"),
        ({"model": "smollm2-135m", "prompt": "x", "echo": True}, "echo"),
        ({"model": "smollm2-135m", "prompt": "x", "suffix": "end"}, "suffix"),
    ],
)
def test_bad_completion_params(harness: Harness, body: Any, param: str) -> None:
    r = harness.client.post("/v1/completions", json=body)
    assert_openai_error(r, 400, param)


@pytest.mark.parametrize(
    "raw", [b"{not json", b"", b"[1, 2]", b'"just a string"', b'{"model": "smollm2-135m",']
)
def test_malformed_bodies_are_400(harness: Harness, raw: bytes) -> None:
    r = harness.client.post(
        "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    err = assert_openai_error(r, 400)
    assert err["type"] == "invalid_request_error"


def test_unknown_models_are_404(harness: Harness) -> None:
    for model in ("nope", "../../etc/passwd"):
        r = harness.client.post("/v1/chat/completions", json=chat(model=model))
        err = assert_openai_error(r, 404, "model")
        assert err["code"] == "model_not_found"
    for path in ("/v1/models/nope", "/v1/models/..%2F..%2Fetc%2Fpasswd", "/v1/models/a/b/c"):
        assert_openai_error(harness.client.get(path), 404)
    r = harness.client.post("/api/models/..%2F..%2Fetc%2Fpasswd/load")
    assert_openai_error(r, 404, "model")


def test_unknown_routes_and_methods(harness: Harness) -> None:
    err = assert_openai_error(harness.client.get("/v1/nothing-here"), 404)
    assert err["type"] == "not_found_error"
    assert_openai_error(harness.client.get("/v1/chat/completions"), 405)


def test_server_keeps_serving_after_bad_input(harness: Harness) -> None:
    harness.client.post("/v1/chat/completions", content=b"{", headers={"content-type": "x"})
    harness.client.post("/v1/chat/completions", json=chat(n=3))
    assert harness.client.post("/v1/chat/completions", json=chat()).status_code == 200
