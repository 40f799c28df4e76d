"""Image checks before decoding (server/openai/images.py): sizes, bombs, formats, URLs, context."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import http.server
import io
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bundled_models import bundled_spec
from vision_gguf import bomb_png, write_projector

from elbowroom.config import Settings
from elbowroom.errors import BadRequest, ContextOverflow, PayloadTooLarge
from elbowroom.models.spec import ModelSpec
from elbowroom.models.vision import read_projector
from elbowroom.server.openai import images
from elbowroom.server.openai.chat_schemas import ChatMessage

LIMITS = images.ImageLimits(
    max_images=2, max_bytes=64 * 1024, max_pixels=1000 * 1000, hosts=frozenset()
)


def encoded(fmt: str, size: tuple[int, int] = (32, 24)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(buf, fmt)
    return buf.getvalue()


def url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> ModelSpec:
    proj = read_projector(write_projector(tmp_path_factory.mktemp("p") / "mmproj-t.gguf"))
    return dataclasses.replace(bundled_spec("smollm2-135m"), projector=proj)


def test_data_urls_decode_within_the_byte_limit() -> None:
    png = encoded("PNG")
    data, text = images.decode_data_url(url(png), LIMITS, "p")
    assert data == png and text == base64.b64encode(png).decode()
    with pytest.raises(PayloadTooLarge) as big:  # refused before decoding
        images.decode_data_url("data:image/png;base64," + "A" * 200_000, LIMITS, "p")
    assert big.value.code == "image_too_large" and "max_image_bytes" in big.value.message
    with pytest.raises(BadRequest) as bad:
        images.decode_data_url("data:image/png;base64,@@@@", LIMITS, "p")
    assert bad.value.code == "invalid_image"
    with pytest.raises(BadRequest) as plain:
        images.decode_data_url("data:image/png,rawbytes", LIMITS, "p")
    assert plain.value.code == "invalid_image_url"


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "BMP"])
def test_formats_the_engine_reads(fmt: str) -> None:
    checked = images.inspect(encoded(fmt), LIMITS, "p")
    assert (checked.format, checked.width, checked.height) == (fmt, 32, 24)
    assert checked.data_url_prefix.startswith("data:image/")


def test_refusals_name_the_problem() -> None:
    with pytest.raises(BadRequest) as webp:
        images.inspect(encoded("WEBP"), LIMITS, "p")
    assert webp.value.code == "unsupported_image_format" and "PNG" in webp.value.message
    with pytest.raises(BadRequest) as text:
        images.inspect(b"hello, not an image", LIMITS, "p")
    assert text.value.code == "invalid_image" and text.value.status == 400
    damaged = bytearray(encoded("PNG"))
    damaged[40] ^= 0xFF  # inside a chunk: its checksum no longer matches
    with pytest.raises(BadRequest) as broken:
        images.inspect(bytes(damaged), LIMITS, "p")
    assert broken.value.code == "invalid_image"
    with pytest.raises(PayloadTooLarge) as wide:  # from the header: 1.2 million pixels
        images.inspect(encoded("PNG", (1200, 1000)), LIMITS, "p")
    assert wide.value.status == 413 and wide.value.details["width"] == 1200


def test_remote_urls_need_the_allow_list() -> None:
    with pytest.raises(BadRequest) as info:
        images.remote_allowed("https://example.com/cat.png", LIMITS, "p")
    assert info.value.code == "remote_image_url" and "image_url_hosts" in info.value.message
    allowed = dataclasses.replace(LIMITS, hosts=frozenset({"example.com"}))
    assert images.remote_allowed("https://example.com/cat.png", allowed, "p")
    assert not images.remote_allowed("data:image/png;base64,AAAA", allowed, "p")
    with pytest.raises(BadRequest):  # the host, not a prefix of it
        images.remote_allowed("https://example.com.evil.net/cat.png", allowed, "p")


def messages(*urls: str) -> list[ChatMessage]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "look"}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [ChatMessage.model_validate({"role": "user", "content": parts})]


def settings(**kw: Any) -> Settings:
    return Settings(data_dir=Path("/nonexistent"), **kw)


def test_check_images_counts_and_normalises(vlm: ModelSpec) -> None:
    msgs = messages(url(encoded("JPEG"), "image/*"))
    assert asyncio.run(images.check_images(msgs, vlm, settings(), 4096, "max_ctx")) == 1
    # The engine gets the media type that was found, whatever the client wrote.
    engine = msgs[0].to_engine()["content"]
    assert engine[0] == {"type": "text", "text": "look"}
    assert engine[1]["image_url"]["url"].startswith("data:image/jpeg;base64,")
    png = url(encoded("PNG"))
    with pytest.raises(PayloadTooLarge) as many:
        asyncio.run(
            images.check_images(messages(png, png, png), vlm, settings(max_images=2), 4096, "x")
        )
    assert many.value.code == "too_many_images"
    with pytest.raises(ContextOverflow) as ctx:  # 4 x 256 image tokens in a 1024 context
        asyncio.run(images.check_images(messages(png, png, png, png), vlm, settings(), 1024, "ctx"))
    assert ctx.value.details == {"image_tokens": 1024, "n_ctx": 1024}


class _Images(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "http://example.com/")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def image_host() -> Iterator[str]:
    _Images.body = encoded("PNG")
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_allowed_host_is_fetched_and_inlined(vlm: ModelSpec, image_host: str) -> None:
    allowed = settings(image_url_hosts=("127.0.0.1",))
    msgs = messages(image_host + "/cat.png")
    asyncio.run(images.check_images(msgs, vlm, allowed, 4096, "x"))
    part = msgs[0].to_engine()["content"][1]
    assert (
        part["image_url"]["url"]
        == "data:image/png;base64," + base64.b64encode(_Images.body).decode()
    )
    with pytest.raises(BadRequest) as moved:  # redirects could leave the allow-list
        asyncio.run(images.check_images(messages(image_host + "/moved"), vlm, allowed, 4096, "x"))
    assert moved.value.code == "image_fetch_failed"
    small = settings(image_url_hosts=("127.0.0.1",), max_image_bytes=16)
    with pytest.raises(PayloadTooLarge):
        asyncio.run(images.check_images(messages(image_host + "/cat.png"), vlm, small, 4096, "x"))
    with pytest.raises(BadRequest) as refused:
        asyncio.run(
            images.check_images(messages(image_host + "/cat.png"), vlm, settings(), 4096, "x")
        )
    assert refused.value.code == "remote_image_url"


def test_pillows_own_bomb_limits_do_not_decide(recwarn: pytest.WarningsRecorder) -> None:
    """Between Pillow's warning (~89 M pixels) and its error (~179 M) the answer is ours:
    within a raised max_image_pixels the image passes, and nothing is warned."""
    png = bomb_png(10_000)  # 100 million pixels
    raised = dataclasses.replace(LIMITS, max_bytes=1 << 20, max_pixels=150_000_000)
    assert images.inspect(png, raised, "p").width == 10_000
    assert not [w for w in recwarn if "pixels" in str(w.message)]
    with pytest.raises(PayloadTooLarge):
        images.inspect(png, dataclasses.replace(raised, max_pixels=99_999_999), "p")
    with pytest.raises(PayloadTooLarge):  # Pillow's own error, past 179 million pixels
        images.inspect(bomb_png(20_000), dataclasses.replace(raised, max_pixels=1 << 40), "p")
