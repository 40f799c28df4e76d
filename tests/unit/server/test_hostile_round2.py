"""What the second hostile probe found (issue 28), each refused before any engine work:
grammar bombs, long integers, inflating images, stalled bodies, 500s that were 400s."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from server_fakes import Harness, http_scope
from vision_gguf import inflating_png

from elbowroom.errors import BadRequest, PayloadTooLarge
from elbowroom.server.deps import parse_keep_alive
from elbowroom.server.http.jsonscan import Limits, inspect
from elbowroom.server.http.schema_limits import check_schemas
from elbowroom.server.openai import images

MODEL = "smollm2-135m"
HI = [{"role": "user", "content": "hi"}]
LIMITS = Limits(
    max_values=10**6,
    max_depth=64,
    max_chars=10**8,
    max_messages=100,
    max_stop=4,
    max_stop_chars=8,
)


def enum_schema(n: int) -> dict[str, Any]:
    return {"type": "object", "properties": {"c": {"enum": [f"v{i}" for i in range(n)]}}}


def chat_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


# --- grammar bombs ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"response_format": chat_format(enum_schema(2000))}),
        ("/api/chat", {"format": enum_schema(2000)}),
        (
            "/v1/chat/completions",
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": f"f{i}", "parameters": enum_schema(30)},
                    }
                    for i in range(10)
                ]
            },
        ),
        ("/api/chat", {"format": {"anyOf": [{"const": i} for i in range(300)]}}),
    ],
)
def test_a_schema_with_too_many_alternatives_is_a_400_before_any_work(
    harness: Harness, path: str, body: dict[str, Any]
) -> None:
    began = time.perf_counter()
    r = harness.client.post(path, json={"model": MODEL, "messages": HI, "stream": False, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    message = error["message"] if isinstance(error, dict) else error
    assert "max_schema_members" in message
    if isinstance(error, dict):
        assert error["code"] == "schema_too_complex"
    assert harness.scheduler.uses == []  # no model was asked for
    assert time.perf_counter() - began < 5.0


def test_schema_bounds() -> None:
    def check(body: dict[str, Any], **limits: int) -> None:
        bounds = {"max_bytes": 10_000, "max_members": 50, "max_repeat": 100} | limits
        check_schemas(body, **bounds)

    check({"response_format": chat_format(enum_schema(49))})  # 49 values and a property
    with pytest.raises(BadRequest, match="max_schema_members"):
        check({"response_format": chat_format(enum_schema(50))})
    # Together: two formats of 30 are 60 members.
    with pytest.raises(BadRequest, match="max_schema_members") as err:
        check({"format": enum_schema(30), "tools": [{"parameters": enum_schema(30)}]})
    assert err.value.param == "tools"
    with pytest.raises(BadRequest, match="max_schema_bytes"):
        check({"format": {"description": "x" * 20_000}})
    for repeat in (
        {"type": "array", "minItems": 101},
        {"type": "string", "maxLength": 10**9},
        {"type": "string", "pattern": "^a{0,100000}$"},
    ):
        with pytest.raises(BadRequest, match="max_schema_repeat"):
            check({"format": {"type": "object", "properties": {"a": repeat}}})
    check({"format": {"type": "string", "pattern": "^a{1,100}$", "maxLength": 100}})
    # A property named "enum" hides nothing.
    hidden = {"type": "object", "properties": {"enum": enum_schema(60)}}
    with pytest.raises(BadRequest, match="max_schema_members"):
        check({"format": hidden})
    # The Responses API's text.format and flat tools.
    with pytest.raises(BadRequest, match="max_schema_members"):
        check({"text": {"format": {"type": "json_schema", "schema": enum_schema(51)}}})
    with pytest.raises(BadRequest, match="max_schema_members"):
        check({"tools": [{"type": "function", "name": "f", "parameters": enum_schema(51)}]})


def test_the_schema_knobs(make_harness: Callable[..., Harness]) -> None:
    h = make_harness(max_schema_members=40_000, max_schema_bytes=10**6)
    body = {"model": MODEL, "messages": HI, "response_format": chat_format(enum_schema(30_000))}
    assert h.client.post("/v1/chat/completions", json=body).status_code == 200


# --- integers -----------------------------------------------------------------------------


def test_long_integers_are_a_400_before_int_converts_them(harness: Harness) -> None:
    # int() of each 4,299-digit literal (just inside Python's own 4,300-digit limit) costs
    # quadratic time: 32 MB of them held the interpreter for seconds.
    with pytest.raises(BadRequest, match="max_int_digits") as err:
        inspect(b'{"seed": [' + b",".join([b"9" * 4299] * 2000) + b"]}", "/v1/x", LIMITS)
    assert err.value.code == "integer_too_long"
    assert inspect(b'{"seed": -12345678901234567890}', "/v1/x", LIMITS).value["seed"] < 0
    r = harness.client.post(
        "/v1/chat/completions",
        content=b'{"model": "smollm2-135m", "messages": [], "seed": ' + b"1" * 100 + b"}",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "integer_too_long"


# --- 400s that were 500s ------------------------------------------------------------------


@pytest.mark.parametrize("key", ["²", "1" * 5000, "٣"])
def test_logit_bias_keys_that_are_not_token_ids(harness: Harness, key: str) -> None:
    body = {"model": MODEL, "messages": HI, "logit_bias": {key: 1}}
    r = harness.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "logit_bias"


def test_a_keep_alive_beyond_a_float_is_a_400() -> None:
    with pytest.raises(BadRequest) as err:
        parse_keep_alive(10**400)
    assert err.value.param == "keep_alive"


def test_api_ps_hides_runner_pids_from_inference_keys(
    make_harness: Callable[..., Harness],
) -> None:
    h = make_harness(api_key="inference", admin_key="admin")
    admin = {"Authorization": "Bearer admin"}
    assert h.client.post(f"/api/models/{MODEL}/load", headers=admin).status_code == 200
    seen = h.client.get("/api/ps", headers={"Authorization": "Bearer inference"}).json()
    assert [m["name"] for m in seen["models"]] == [f"{MODEL}:latest"]
    assert "pid" not in seen["models"][0]
    assert h.client.get("/api/ps", headers=admin).json()["models"][0]["pid"] == 1234


# --- bodies ---------------------------------------------------------------------------------


def asgi_post(
    app: Any,
    path: str,
    headers: list[tuple[bytes, bytes]],
    chunks: list[bytes],
    *,
    then_wait: bool = True,
) -> tuple[int, dict[str, Any]]:
    """One POST into the ASGI app; after ``chunks`` the client sends nothing more (a stalled
    body) and never disconnects."""
    sent: list[dict[str, Any]] = []
    pending = [
        {"type": "http.request", "body": c, "more_body": then_wait or i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = http_scope(
        path, [(b"host", b"localhost"), (b"content-type", b"application/json"), *headers], app=app
    )
    asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout=60))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body)


def test_a_1gib_content_length_on_an_ollama_route_is_413(harness: Harness) -> None:
    status, body = asgi_post(
        harness.client.app, "/api/chat", [(b"content-length", str(1 << 30).encode())], []
    )
    assert status == 413, body
    assert "max_body" in body["error"]


def test_a_stalled_body_times_out_and_gives_its_budget_back(
    make_harness: Callable[..., Harness],
) -> None:
    h = make_harness(body_timeout=0.3, max_body_inflight=1024**2)
    app = h.client.app
    head = [(b"content-length", str(900 * 1024).encode())]
    began = time.perf_counter()
    status, body = asgi_post(app, "/v1/chat/completions", head, [b"{" + b" " * 400_000])
    assert status == 408 and body["error"]["code"] == "body_timeout"
    assert "body_timeout" in body["error"]["message"]
    assert time.perf_counter() - began < 10
    # Its bytes were given back: a 600 KB body fits the 1 MiB budget again.
    big = {"model": MODEL, "messages": [{"role": "user", "content": "z" * 600_000}]}
    assert h.client.post("/v1/chat/completions", json=big).status_code == 200


def test_a_declared_body_that_never_comes_holds_no_budget(
    make_harness: Callable[..., Harness],
) -> None:
    """Four connections declaring 32 MiB and sending nothing held max_body_inflight: every
    large request got 503 meanwhile."""
    h = make_harness(body_timeout=5, max_body_inflight=1024**2)
    app = h.client.app
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "z" * 600_000}]})

    async def both() -> tuple[int, int]:
        stalled = asyncio.create_task(
            asyncio.to_thread(
                asgi_post,
                app,
                "/v1/chat/completions",
                [(b"content-length", str(900 * 1024).encode())],
                [],
            )
        )
        await asyncio.sleep(0.2)
        ok = await asyncio.to_thread(
            h.client.post,
            "/v1/chat/completions",
            content=big,
            headers={"content-type": "application/json"},
        )
        return ok.status_code, (await stalled)[0]

    assert asyncio.run(both()) == (200, 408)  # served while the other one was stalled


# --- images ---------------------------------------------------------------------------------

IMG_LIMITS = images.ImageLimits(
    max_images=4, max_bytes=10 * 1024**2, max_pixels=25_000_000, hosts=frozenset()
)


def test_a_png_that_inflates_past_its_pixels_is_refused_without_inflating_it() -> None:
    bomb = inflating_png(64 * 1024**2)  # 1 x 1 pixel, 64 MiB of image data
    assert len(bomb) < 100_000
    began = time.perf_counter()
    with pytest.raises(PayloadTooLarge, match="decompression bomb") as err:
        images.inspect(bomb, IMG_LIMITS, "p")
    assert err.value.code == "image_too_large"
    assert time.perf_counter() - began < 2.0
    honest = inflating_png(images.png_data_bytes(64, 64, 24, False), side=64)
    assert images.inspect(honest, IMG_LIMITS, "p").width == 64
    laced = inflating_png(images.png_data_bytes(5, 5, 24, True), side=5, interlaced=True)
    assert images.inspect(laced, IMG_LIMITS, "p").width == 5
    with pytest.raises(PayloadTooLarge):
        images.inspect(
            inflating_png(images.png_data_bytes(5, 5, 24, True) + 1, side=5, interlaced=True),
            IMG_LIMITS,
            "p",
        )


def test_real_pngs_pass() -> None:
    from PIL import Image

    for mode, size in (("RGB", (300, 200)), ("RGBA", (17, 5)), ("L", (9, 9)), ("P", (40, 3))):
        buf = io.BytesIO()
        Image.new(mode, size).save(buf, "PNG")
        assert images.inspect(buf.getvalue(), IMG_LIMITS, "p").width == size[0]
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(buf, "JPEG", progressive=True)
    assert images.inspect(buf.getvalue(), IMG_LIMITS, "p").format == "JPEG"


def test_a_jpeg_of_thousands_of_scans_is_refused() -> None:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(buf, "JPEG", progressive=True)
    jpeg = buf.getvalue()
    scan = jpeg[jpeg.index(b"\xff\xda") : jpeg.index(b"\xff\xda") + 12]
    crafted = jpeg[:-2] + scan * 1000 + b"\xff\xd9"
    with pytest.raises(PayloadTooLarge, match="scans"):
        images.inspect(crafted, IMG_LIMITS, "p")


def test_a_requests_images_together_are_bounded() -> None:
    from PIL import Image

    from elbowroom.server.openai.chat_schemas import ChatMessage

    buf = io.BytesIO()
    Image.new("RGB", (1000, 1000)).save(buf, "PNG")
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}
    encoded = base64.b64encode(buf.getvalue()).decode()

    def message() -> ChatMessage:
        spot = {**part, "image_url": {"url": part["image_url"]["url"] + encoded}}
        return ChatMessage.model_validate({"role": "user", "content": [spot, dict(spot)]})

    from bundled_models import bundled_spec

    from elbowroom.config import Settings

    spec = bundled_spec(MODEL)
    ok = Settings(max_decoded_image_bytes=8 * 1000 * 1000)
    assert asyncio.run(images.check_images([message()], spec, ok, 10**6, "x")) == 2
    tight = Settings(max_decoded_image_bytes=6 * 1000 * 1000)
    with pytest.raises(PayloadTooLarge, match="max_decoded_image_bytes"):
        asyncio.run(images.check_images([message()], spec, tight, 10**6, "x"))


# --- discovery ------------------------------------------------------------------------------

DISCOVER = """
import json, sys
from elbowroom.config import Settings
from elbowroom.models.catalog import discover
from pathlib import Path
catalog = discover(Settings(models_dir=Path(sys.argv[1]), data_dir=Path(sys.argv[2])))
print(json.dumps([[str(p.path), p.reason] for p in catalog.problems]))
"""


def test_discovery_lists_what_it_cannot_stat_as_a_problem(tmp_path: Path) -> None:
    """An entry whose stat() fails (a symlink into /proc/1/cwd or a 0644 folder for a user
    who is not root; here, for root too, a link to a name too long to stat) stopped serve and
    ls with a traceback."""
    from elbowroom.config import Settings
    from elbowroom.models.catalog import discover

    root = tmp_path / "models"
    root.mkdir()
    (root / "long").symlink_to("x" * 300)  # ENAMETOOLONG, for root as for anyone
    if os.geteuid() != 0:
        (root / "closed").mkdir()
        (root / "closed" / "m.gguf").write_bytes(b"GGUF")
        (root / "closed").chmod(0o644)
    try:
        catalog = discover(Settings(models_dir=root, data_dir=tmp_path / "data"))
    finally:
        if (root / "closed").exists():
            (root / "closed").chmod(0o755)
    problems = {p.path.name: p.reason for p in catalog.problems}
    assert "long" in problems and "too long" in problems["long"], problems


# --- the prompt-size bound -------------------------------------------------------------------


def test_the_prompt_bound_counts_every_text_field_a_runner_is_sent() -> None:
    """A 4 M-character ``system`` on /api/generate or a tool description reached the runner,
    which tokenized 2 M tokens for 13-16 s before its 400."""

    def chars(path: str, body: dict[str, Any]) -> int:
        return inspect(json.dumps(body).encode(), path, LIMITS).prompt_chars

    assert chars("/api/generate", {"prompt": "ab", "system": "x" * 1000}) == 1002
    assert chars("/v1/completions", {"prompt": "ab", "suffix": "cd"}) == 4
    tool = {"type": "function", "function": {"name": "f", "description": "d" * 5000}}
    assert chars("/v1/chat/completions", {"messages": HI, "tools": [tool]}) == 2 + 1 + 5000 + 8
    call = {"function": {"name": "f", "arguments": "a" * 300}}
    msgs = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    assert chars("/api/chat", {"messages": msgs}) == 301


def test_a_gguf_without_tensors_is_a_clear_load_error(tmp_path: Path) -> None:
    """It failed in llama.cpp with "no reason given": a 500 and a new runner per request."""
    from crafted_gguf import gguf, model_kvs

    from elbowroom.config import Settings
    from elbowroom.engines.llama import LlamaEngine
    from elbowroom.engines.options import LlamaOptions
    from elbowroom.errors import Unprocessable
    from elbowroom.models.catalog import discover

    (tmp_path / "empty.gguf").write_bytes(gguf(model_kvs()))
    catalog = discover(Settings(models_dir=tmp_path, data_dir=tmp_path / "data"))
    spec = catalog.get("empty")
    with pytest.raises(Unprocessable, match="no tensors") as err:
        LlamaEngine().load(spec, LlamaOptions())
    assert err.value.status == 422


def test_ps_busy_counts_what_the_engine_still_works_on(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler stops counting a request when its client leaves; the runner keeps
    counting it until the engine lets go (a grammar still being set up on the engine's
    loop). /api/elbowroom/ps said idle meanwhile; its busy is now the larger of
    the two."""
    from server_fakes import FakeRunner, FakeScheduler

    harness.scheduler.loaded["smollm2-135m"] = False
    monkeypatch.setattr(
        FakeScheduler, "ps", lambda self: [{"id": m, "busy": 0} for m in self.loaded]
    )

    async def stats(self: FakeRunner) -> dict[str, Any]:
        return {"slots": 4, "slots_busy": 1}

    monkeypatch.setattr(FakeRunner, "stats", stats)
    row = harness.client.get("/api/elbowroom/ps").json()["models"][0]
    assert row["busy"] == 1
