"""Admin routes, the API key, the exposure rule and keep_alive parsing."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
from server_fakes import Harness

from elbowroom.errors import BadRequest
from elbowroom.server.deps import parse_keep_alive
from elbowroom.server.http.auth import check_exposure, is_loopback


def test_health(harness: Harness) -> None:
    assert harness.client.get("/health").json() == {"status": "ok"}


def test_load_ps_unload(harness: Harness) -> None:
    r = harness.client.post("/api/models/smollm2-135m/load", json={"pin": True})
    assert r.status_code == 200
    assert r.json()["pinned"] is True and r.json()["runner"]["pid"] == 1234
    assert harness.scheduler.loaded == {"smollm2-135m": True}
    ps = harness.client.get("/api/ps").json()
    assert [m["id"] for m in ps["models"]] == ["smollm2-135m"]
    assert ps["models"][0]["engine_stats"] == {"kv_cache": {"entries_ram": 1}}  # from the runner
    memory = {"limit": 1000, "committed": 10, "available": 990, "pressure": "normal"}
    assert ps["memory"] == {**memory, "scope": "machine", "ceiling": ps["memory"]["ceiling"]}
    # No body keeps the pin as it is; {"pin": false} unpins.
    assert harness.client.post("/api/models/smollm2-135m/load").json()["pinned"] is True
    r = harness.client.post("/api/models/smollm2-135m/load", json={"pin": False})
    assert r.json()["pinned"] is False
    assert harness.client.post("/api/models/whisper-tiny.en/load").json()["pinned"] is False
    r = harness.client.post("/api/models/smollm2-135m/unload")
    assert r.json() == {"model": "smollm2-135m", "status": "unloaded", "freed": 10}
    assert harness.scheduler.loaded == {"whisper-tiny.en": False}
    again = harness.client.post("/api/models/smollm2-135m/unload").json()
    assert again["status"] == "not_loaded"


def test_load_rejects_bad_bodies(harness: Harness) -> None:
    for body in ({"pin": "yes"}, {"pinned": True}):
        r = harness.client.post("/api/models/smollm2-135m/load", json=body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert harness.scheduler.loaded == {}


def test_memory_with_and_without_history(harness: Harness) -> None:
    assert "history" not in harness.client.get("/api/memory").json()
    report = harness.client.get("/api/memory", params={"history": 1}).json()
    assert report["history"] == [{"available": 5}]
    assert report["limit"]["value"] == 1000


def test_api_key_guards_v1_and_api_but_not_health(
    make_harness: Callable[..., Harness],
) -> None:
    h = make_harness(api_key="s3cret")
    assert h.client.get("/health").status_code == 200
    for method, path in (
        ("GET", "/v1/models"),
        ("GET", "/api/elbowroom/ps"),
        ("GET", "/api/memory"),
        ("GET", "/v1/unknown"),
        ("POST", "/v1/chat/completions"),
    ):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = h.client.request(method, path, headers=headers)
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["type"] == "authentication_error"
            assert r.json()["error"]["code"] == "invalid_api_key"
    ok = h.client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200
    # Ollama's routes answer in Ollama's shape; the dashboard page itself holds no data.
    for method, path in (("GET", "/api/ps"), ("GET", "/api/tags"), ("POST", "/api/chat")):
        r = h.client.request(method, path)
        assert r.status_code == 401
        assert r.json()["error"].startswith("Missing API key")
    assert h.client.get("/ui").status_code == 200
    assert h.client.get("/api/elbowroom/dashboard").status_code == 401


@pytest.mark.parametrize(
    ("host", "key", "refused"),
    [
        ("127.0.0.1", None, False),
        ("127.0.0.2", None, False),
        ("::1", None, False),
        ("localhost", None, False),
        ("0.0.0.0", None, True),
        ("::", None, True),
        ("192.168.1.5", None, True),
        ("myhost.lan", None, True),
        ("0.0.0.0", "k", False),
    ],
)
def test_exposure_rule(host: str, key: str | None, refused: bool) -> None:
    reason = check_exposure(host, key)
    assert (reason is not None) == refused
    if reason:
        assert "--api-key" in reason and host in reason
    assert is_loopback(host) == (host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, None),
        (0, 0.0),
        (30, 30.0),
        (1.5, 1.5),
        ("45", 45.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("250ms", 0.25),
        (" 10s ", 10.0),
        (-1, math.inf),
        ("-1", math.inf),
        ("-5m", math.inf),
    ],
)
def test_keep_alive_values(value: Any, seconds: float | None) -> None:
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5x", "m5", "", "5m junk", True, [5], {"s": 1}, "nan"])
def test_keep_alive_rejects(value: Any) -> None:
    with pytest.raises(BadRequest) as info:
        parse_keep_alive(value)
    assert info.value.param == "keep_alive"
