"""/api/pull and /api/delete are admin operations, and never for a page of another origin
(the downloads themselves: tests/unit/models/test_pull.py, tests/e2e/test_e2e_pull.py)."""

from __future__ import annotations

from collections.abc import Callable

from server_fakes import Harness

PULL = {"model": "hf.co/test/SmolLM2-GGUF"}


def test_an_inference_key_cannot_pull_or_delete(make_harness: Callable[..., Harness]) -> None:
    h = make_harness(api_key="infer", admin_key="adm")
    for method, path in (("POST", "/api/pull"), ("DELETE", "/api/delete")):
        r = h.client.request(method, path, json=PULL, headers={"Authorization": "Bearer infer"})
        assert r.status_code == 403, r.text
        assert "admin route" in r.json()["error"]  # Ollama's shape
    # the same key still chats: only these two Ollama routes are admin
    r = h.client.get("/api/tags", headers={"Authorization": "Bearer infer"})
    assert r.status_code == 200
    # the admin key gets through to the route (a bad name: its 400, before any network)
    r = h.client.post(
        "/api/pull", json={"model": "llama3"}, headers={"Authorization": "Bearer adm"}
    )
    assert r.status_code == 400 and "not Ollama's library" in r.json()["error"]


def test_a_listed_origin_may_chat_but_not_pull(make_harness: Callable[..., Harness]) -> None:
    h = make_harness(allowed_origins=("http://app.example",))
    page = {"Origin": "http://app.example"}
    assert h.client.get("/api/tags", headers=page).status_code == 200
    for method, path in (("POST", "/api/pull"), ("DELETE", "/api/delete")):
        r = h.client.request(method, path, json=PULL, headers=page)
        assert r.status_code == 403, r.text
        assert "changes the models this server has" in r.json()["error"]
    # the server's own page (same origin) may
    own = {"Origin": "http://localhost"}
    r = h.client.post("/api/pull", json={"model": "llama3"}, headers=own)
    assert r.status_code == 400, r.text


def test_deleting_a_model_not_pulled_unloads_nothing(harness: Harness) -> None:
    r = harness.client.post("/api/models/smollm2-135m/load", json={"pin": True})
    assert r.status_code == 200
    r = harness.client.request("DELETE", "/api/delete", json={"model": "smollm2-135m"})
    assert r.status_code == 400 and "not pulled by elbowroom" in r.json()["error"], r.text
    assert harness.scheduler.loaded == {"smollm2-135m": True}  # still loaded and pinned


def test_undecodable_bodies_get_ollamas_shape(harness: Harness) -> None:
    for method, path in (("POST", "/api/pull"), ("DELETE", "/api/delete")):
        r = harness.client.request(
            method, path, content=b"\xa5SkK\x02B", headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and isinstance(r.json()["error"], str), r.text
