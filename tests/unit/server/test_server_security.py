"""Request-origin safety and keys: Host allow-list, Origin check, CORS, content type, admin key.

Every request goes through the real app (all middleware) over the fakes in server_fakes.py;
the fake scheduler records whether any work started, so "refused before work" is checked.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from server_fakes import Harness

from elbowroom.server.http.origin import OriginPolicy, split_host

CHAT = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "x"}]}


def chat(h: Harness, **headers: str) -> tuple[int, dict]:
    r = h.client.post("/v1/chat/completions", json=CHAT, headers=headers)
    return r.status_code, r.json() if r.headers.get("content-type", "").startswith(
        "application/json"
    ) else {}


# --- Host -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    ["localhost", "localhost:8000", "127.0.0.1:8000", "127.9.9.9", "[::1]:8000", "a.localhost"],
)
def test_loopback_hosts_pass(harness: Harness, host: str) -> None:
    assert chat(harness, host=host)[0] == 200


@pytest.mark.parametrize(
    "host", ["evil.example", "evil.example:8000", "192.168.1.5", "localhost.evil"]
)
def test_a_rebinding_host_is_refused_before_any_work(harness: Harness, host: str) -> None:
    status, body = chat(harness, host=host)
    assert status == 403
    assert body["error"]["code"] == "host_not_allowed"
    assert "allowed_hosts" in body["error"]["message"]
    assert harness.scheduler.uses == []


def test_allowed_hosts_adds_names_and_wildcards(make_harness: Callable[..., Harness]) -> None:
    h = make_harness(allowed_hosts=("box.lan", "*.example.org"))
    assert chat(h, host="box.lan:8000")[0] == 200
    assert chat(h, host="api.example.org")[0] == 200
    assert chat(h, host="localhost")[0] == 200  # loopback names always pass
    assert chat(h, host="example.org.evil")[0] == 403
    anyhost = make_harness(allowed_hosts=("*",))
    assert chat(anyhost, host="whatever.example")[0] == 200


def test_a_network_bind_takes_any_host_behind_its_key(make_harness: Callable[..., Harness]) -> None:
    h = make_harness(host="0.0.0.0", api_key="k")
    assert chat(h, host="192.168.1.5:8000", authorization="Bearer k")[0] == 200
    assert chat(h, host="192.168.1.5:8000")[0] == 401


def test_split_host() -> None:
    assert split_host("LocalHost.:80") == ("localhost", "80")
    assert split_host("[::1]:8000") == ("::1", "8000")
    assert split_host("::1") == ("::1", "")
    assert split_host("example.com") == ("example.com", "")


# --- Origin -----------------------------------------------------------------------------


@pytest.mark.parametrize("origin", ["https://evil.example", "null", "http://localhost:3000"])
def test_cross_origin_posts_are_refused_before_any_work(harness: Harness, origin: str) -> None:
    status, body = chat(harness, origin=origin)
    assert status == 403
    assert body["error"]["code"] == "origin_not_allowed"
    assert harness.scheduler.uses == []


def test_a_cross_site_form_cannot_unload(harness: Harness) -> None:
    harness.client.post("/api/models/smollm2-135m/load")
    r = harness.client.post(
        "/api/models/smollm2-135m/unload",
        content=b"x=1",
        headers={
            "origin": "https://evil.example",
            "content-type": "application/x-www-form-urlencoded",
        },
    )
    assert r.status_code == 403
    assert harness.scheduler.loaded == {"smollm2-135m": False}


def test_same_origin_and_no_origin_pass(harness: Harness) -> None:
    assert chat(harness, origin="http://localhost")[0] == 200
    assert chat(harness, origin="http://localhost:8000", host="localhost:8000")[0] == 200
    assert chat(harness)[0] == 200  # curl, SDKs: no Origin
    # Same host, other port: another origin.
    assert chat(harness, origin="http://localhost:9999", host="localhost:8000")[0] == 403


def test_sec_fetch_site_without_origin(harness: Harness) -> None:
    assert chat(harness, **{"sec-fetch-site": "cross-site"})[0] == 403
    assert chat(harness, **{"sec-fetch-site": "same-origin"})[0] == 200
    r = harness.client.get("/v1/models", headers={"sec-fetch-site": "cross-site"})
    assert r.status_code == 200  # a link followed from another site reads nothing it can keep


def test_no_cors_headers_unless_configured(harness: Harness) -> None:
    r = harness.client.post(
        "/v1/chat/completions", json=CHAT, headers={"origin": "http://localhost"}
    )
    assert r.status_code == 200
    assert "access-control-allow-origin" not in r.headers
    pre = harness.client.options(
        "/v1/chat/completions",
        headers={"origin": "http://localhost:3000", "access-control-request-method": "POST"},
    )
    assert pre.status_code == 403


def test_allowed_origins_get_cors(make_harness: Callable[..., Harness]) -> None:
    h = make_harness(allowed_origins=("http://localhost:3000", "https://app.example:*"))
    r = h.client.post(
        "/v1/chat/completions", json=CHAT, headers={"origin": "http://localhost:3000"}
    )
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "Origin" in r.headers["vary"]
    pre = h.client.options(
        "/v1/chat/completions",
        headers={
            "origin": "https://app.example:4443",
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type",
        },
    )
    assert pre.status_code == 204
    assert pre.headers["access-control-allow-origin"] == "https://app.example:4443"
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert chat(h, origin="http://localhost:3001")[0] == 403
    assert chat(h, origin="http://app.example:4443")[0] == 403  # scheme differs
    assert h.scheduler.uses == [("smollm2-135m", None)]


def test_origin_policy_star_and_null() -> None:
    from elbowroom.config import Settings

    star = OriginPolicy.from_settings(Settings(allowed_origins=("*",)))
    assert star.origin_allowed("https://anything.example", "localhost")
    assert star.cors
    null = OriginPolicy.from_settings(Settings(allowed_origins=("null",)))
    assert null.origin_allowed("null", "localhost")
    assert not null.origin_allowed("https://x.example", "localhost")


# --- content type -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"],
)
def test_json_routes_need_a_json_content_type(harness: Harness, content_type: str | None) -> None:
    headers = {"content-type": content_type} if content_type else {}
    r = harness.client.post(
        "/v1/chat/completions",
        content=b'{"model":"smollm2-135m","messages":[{"role":"user","content":"x"}]}',
        headers=headers,
    )
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported_media_type"
    assert "--json" in r.json()["error"]["message"]
    assert harness.scheduler.uses == []


def test_json_variants_pass(harness: Harness) -> None:
    for ctype in ("application/json; charset=utf-8", "Application/JSON"):
        r = harness.client.post(
            "/v1/chat/completions",
            content=b'{"model":"smollm2-135m","messages":[{"role":"user","content":"x"}]}',
            headers={"content-type": ctype},
        )
        assert r.status_code == 200, (ctype, r.text)


def test_bodyless_admin_posts_need_no_content_type(harness: Harness) -> None:
    assert harness.client.post("/api/models/smollm2-135m/load").status_code == 200
    assert harness.client.post("/api/models/smollm2-135m/unload").status_code == 200


# --- keys -------------------------------------------------------------------------------


@pytest.fixture
def keyed(make_harness: Callable[..., Harness]) -> Harness:
    return make_harness(api_key="inf1", api_keys=("inf2",), admin_key="adm")


def get(h: Harness, path: str, key: str | None) -> int:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return h.client.get(path, headers=headers).status_code


@pytest.mark.parametrize(
    "path",
    [
        "/api/elbowroom/ps",
        "/api/memory",
        "/api/elbowroom/models",
        "/api/guard",
        "/metrics",
        "/openapi.json",
    ],
)
def test_admin_paths_need_the_admin_key(keyed: Harness, path: str) -> None:
    assert get(keyed, path, None) == 401
    assert get(keyed, path, "wrong") == 401
    assert get(keyed, path, "inf1") == 403
    assert get(keyed, path, "adm") == 200


def test_inference_keys_and_admin_key_open_v1(keyed: Harness) -> None:
    for key in ("inf1", "inf2", "adm"):
        assert get(keyed, "/v1/models", key) == 200
    assert get(keyed, "/v1/models", None) == 401
    assert get(keyed, "/health", None) == 200
    assert get(keyed, "/no/such/path", None) == 401  # unknown paths leak nothing either


def test_inference_key_cannot_unload(keyed: Harness) -> None:
    keyed.client.post("/api/models/smollm2-135m/load", headers={"authorization": "Bearer adm"})
    r = keyed.client.post(
        "/api/models/smollm2-135m/unload", headers={"authorization": "Bearer inf2"}
    )
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    assert keyed.scheduler.loaded == {"smollm2-135m": False}


def test_one_api_key_is_also_the_admin_key(make_harness: Callable[..., Harness]) -> None:
    h = make_harness(api_key="only")
    assert get(h, "/api/ps", "only") == 200
    assert get(h, "/metrics", "only") == 200
    assert get(h, "/metrics", None) == 401
