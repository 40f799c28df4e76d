"""Images in chat requests: checked before any decoding, model load or engine work.

An ``image_url`` part carries a ``data:`` URL (``data:image/png;base64,...``). A remote
``http(s)`` URL is refused unless its host is in ``image_url_hosts`` (the server must not
fetch arbitrary URLs for whoever can reach it); an allowed one is fetched here, bounded in
bytes and time, and passed on as a data: URL. For every image, in this order:

1. ``max_images`` per request (413);
2. its encoded size against ``max_image_bytes`` before base64 is decoded (413);
3. base64 that does not decode: 400;
4. the header (Pillow reads only the header): not an image, or a format llama.cpp's decoder
   cannot read (it takes PNG, JPEG, GIF, BMP): 400;
5. width x height against ``max_image_pixels``, from the header, before a pixel is decoded
   (decompression bombs: a 20,000 x 20,000 PNG is ~1 MB of bytes, 1.2 GB of pixels): 413;
6. the file's integrity (``verify``: PNG checksums, without decoding pixels): 400;
7. what decoding would cost beyond the pixels (``inflation``): a PNG's image data is
   inflated here while counting, and refused (413) past what its declared pixels need (a
   1 MB PNG of 1 x 1 pixel whose data inflates to 1 GiB made the engine allocate ~900 MB);
   a JPEG may have at most ``MAX_JPEG_SCANS`` scans (a progressive JPEG of thousands of
   scans decodes the whole image again for each).

Then the request's images together against ``max_decoded_image_bytes`` (width x height x 4
each: what the engine's decoder holds), 413, and the request's image tokens (images x the
projector's tokens per image) against the largest context the model can get: 400
``context_length_exceeded``.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import struct
import warnings
import zlib
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from elbowroom.config import Settings
from elbowroom.errors import BadRequest, ContextOverflow, PayloadTooLarge
from elbowroom.models.spec import ModelSpec
from elbowroom.units import format_size

# Formats llama.cpp's image decoder (stb_image) reads, and their media types.
ENGINE_FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "BMP": "image/bmp"}
FETCH_TIMEOUT = 10.0  # seconds for one allowed remote image
MAX_JPEG_SCANS = 64  # encoders write 1 (baseline) to ~10 (progressive)
DECODED_BYTES_PER_PIXEL = 4  # RGBA: the most the engine's decoder holds per pixel
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # by color type
# Adam7's passes: first column and row, column and row steps
_ADAM7: tuple[tuple[int, int, int, int], ...] = (
    (0, 0, 8, 8),
    (4, 0, 8, 8),
    (0, 4, 4, 8),
    (2, 0, 4, 4),
    (0, 2, 2, 4),
    (1, 0, 2, 2),
    (0, 1, 1, 2),
)
_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+*-]+)?(?P<params>(;[^;,]*)*?);base64,", re.I)


@dataclass(frozen=True, slots=True)
class ImageLimits:
    max_images: int
    max_bytes: int
    max_pixels: int
    hosts: frozenset[str]
    max_decoded: int = 256 * 1024**2

    @staticmethod
    def of(settings: Settings) -> ImageLimits:
        return ImageLimits(
            settings.max_images,
            settings.max_image_bytes,
            settings.max_image_pixels,
            frozenset(h.lower() for h in settings.image_url_hosts),
            settings.max_decoded_image_bytes,
        )


@dataclass(frozen=True, slots=True)
class Checked:
    format: str  # PNG, JPEG, ...
    width: int
    height: int
    nbytes: int

    @property
    def data_url_prefix(self) -> str:
        return f"data:{ENGINE_FORMATS[self.format]};base64,"


def decode_data_url(url: str, limits: ImageLimits, param: str) -> tuple[bytes, str]:
    """The bytes of a base64 ``data:`` URL and its base64 text; 413 when too large (checked
    before decoding)."""
    match = _DATA_URL.match(url)
    if match is None:
        raise BadRequest(
            "an image_url must be a base64 data: URL (data:image/png;base64,...)",
            param=param,
            code="invalid_image_url",
        )
    encoded = url[match.end() :]
    if len(encoded) // 4 * 3 > limits.max_bytes:
        raise _too_large(f"about {format_size(len(encoded) // 4 * 3)}", limits, param)
    try:
        return base64.b64decode(encoded, validate=True), encoded
    except (binascii.Error, ValueError) as exc:
        raise BadRequest(
            f"the image's base64 does not decode ({exc})", param=param, code="invalid_image"
        ) from None


def inspect(data: bytes, limits: ImageLimits, param: str) -> Checked:
    """PURE but for Pillow: what the image is, from its header, within the limits."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise _too_large(format_size(len(data)), limits, param)
    try:
        with warnings.catch_warnings():
            # Pillow warns above ~89 million pixels; the limit is ours (max_image_pixels).
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            opened = Image.open(io.BytesIO(data))  # reads the header only
        with opened as img:
            fmt, (width, height) = str(img.format), img.size
            if fmt not in ENGINE_FORMATS:
                raise BadRequest(
                    f"images in {fmt} cannot be read by the engine: send PNG, JPEG, GIF or BMP",
                    param=param,
                    code="unsupported_image_format",
                )
            if width * height > limits.max_pixels:
                raise _too_many_pixels(width, height, limits, param)
            img.verify()
        check_inflation(data, fmt, param)
    except Image.DecompressionBombError:
        # Pillow's own bomb check (above ~179 million pixels) fired before ours could.
        raise PayloadTooLarge(
            f"the image has far more than max_image_pixels ({limits.max_pixels:,}) pixels: "
            "scale it down",
            param=param,
            code="image_too_large",
        ) from None
    except UnidentifiedImageError:
        raise BadRequest(
            "the data is not an image (or not one in PNG, JPEG, GIF or BMP)",
            param=param,
            code="invalid_image",
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:  # verify(): damaged file
        raise BadRequest(
            f"the image is damaged ({exc})", param=param, code="invalid_image"
        ) from None
    return Checked(fmt, width, height, len(data))


def check_inflation(data: bytes, fmt: str, param: str) -> None:
    """Refuse an image whose decoding costs more than its pixels: a PNG whose image data
    inflates past what its header's width, height, depth and interlacing need (inflated
    here in 64 KiB steps, counting, never whole), a JPEG of more than ``MAX_JPEG_SCANS``
    scans."""
    if fmt == "PNG":
        _check_png(data, param)
    elif fmt == "JPEG":
        # In entropy-coded data every 0xFF is followed by 0x00 or a restart marker: a
        # 0xFF 0xDA pair is always a start-of-scan marker.
        scans = data.count(b"\xff\xda")
        if scans > MAX_JPEG_SCANS:
            raise PayloadTooLarge(
                f"the JPEG has {scans} scans; at most {MAX_JPEG_SCANS} are decoded (each "
                "one decodes the whole image again)",
                param=param,
                code="image_too_large",
            )


def png_data_bytes(width: int, height: int, bits: int, interlaced: bool) -> int:
    """The bytes a PNG's inflated image data has: a filter byte per row, then the row's
    pixels at ``bits`` per pixel; seven smaller images when interlaced (Adam7)."""
    if not interlaced:
        return height * (1 + (width * bits + 7) // 8)
    total = 0
    for x0, y0, dx, dy in _ADAM7:
        cols = (width - x0 + dx - 1) // dx if width > x0 else 0
        rows = (height - y0 + dy - 1) // dy if height > y0 else 0
        if cols and rows:
            total += rows * (1 + (cols * bits + 7) // 8)
    return total


def _check_png(data: bytes, param: str) -> None:
    if len(data) < 33:
        return  # Pillow read a header from it: nothing to inflate
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", data[16:29])
    need = png_data_bytes(width, height, depth * _PNG_CHANNELS.get(color, 4), interlace == 1)
    inflater = zlib.decompressobj()
    got = 0
    pos = 8
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        if kind == b"IDAT":
            chunk = data[pos + 8 : pos + 8 + length]
            while chunk:
                try:
                    got += len(inflater.decompress(chunk, 65536))
                except zlib.error as exc:
                    raise BadRequest(
                        f"the image is damaged (its data does not inflate: {exc})",
                        param=param,
                        code="invalid_image",
                    ) from None
                if got > need:
                    raise PayloadTooLarge(
                        f"the PNG's image data inflates to more than the {need:,} bytes its "
                        f"{width} x {height} pixels need (a decompression bomb)",
                        param=param,
                        code="image_too_large",
                    )
                chunk = inflater.unconsumed_tail
        elif kind == b"IEND":
            break
        pos += 12 + length


def _too_large(size: str, limits: ImageLimits, param: str) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"the image is {size}; max_image_bytes is {format_size(limits.max_bytes)}: send a "
        "smaller image or raise max_image_bytes",
        param=param,
        code="image_too_large",
    )


def _too_many_pixels(width: int, height: int, limits: ImageLimits, param: str) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"the image is {width} x {height} = {width * height:,} pixels; max_image_pixels is "
        f"{limits.max_pixels:,}: scale it down or raise max_image_pixels",
        param=param,
        code="image_too_large",
        details={"width": width, "height": height, "max_image_pixels": limits.max_pixels},
    )


async def fetch(url: str, limits: ImageLimits, param: str) -> bytes:
    """An image from an allowed host, bounded by ``max_bytes`` and ``FETCH_TIMEOUT``;
    redirects are not followed (they could lead off the allow-list)."""
    import httpx

    try:
        async with (
            httpx.AsyncClient(follow_redirects=False, timeout=FETCH_TIMEOUT) as client,
            client.stream("GET", url) as reply,
        ):
            if reply.status_code != 200:
                raise BadRequest(
                    f"fetching the image failed: HTTP {reply.status_code}",
                    param=param,
                    code="image_fetch_failed",
                )
            data = bytearray()
            async for chunk in reply.aiter_bytes():
                data += chunk
                if len(data) > limits.max_bytes:
                    raise _too_large(f"over {format_size(limits.max_bytes)}", limits, param)
            return bytes(data)
    except httpx.HTTPError as exc:
        raise BadRequest(
            f"fetching the image failed: {type(exc).__name__}: {exc}",
            param=param,
            code="image_fetch_failed",
        ) from None


def remote_allowed(url: str, limits: ImageLimits, param: str) -> bool:
    """True for an http(s) URL whose host is allowed; 400 for any other remote URL."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https"):
        return False
    host = (parts.hostname or "").lower()
    if host and host in limits.hosts:
        return True
    raise BadRequest(
        f"remote image URLs are not fetched (host {host!r} is not in image_url_hosts): send "
        "the image inline as a data: URL (data:image/png;base64,...), or allow the host "
        "with image_url_hosts",
        param=param,
        code="remote_image_url",
    )


async def check_images(
    messages: list[Any], spec: ModelSpec, settings: Settings, max_ctx: int, why: str
) -> int:
    """Check every image part of ``messages`` (ChatMessage objects) in place: an allowed
    remote URL becomes a data: URL. Returns the number of images."""
    limits = ImageLimits.of(settings)
    parts = [
        (i, j, part)
        for i, msg in enumerate(messages)
        for j, part in enumerate(msg.content if isinstance(msg.content, list) else ())
        if part.type == "image_url"
    ]
    if not parts:
        return 0
    if len(parts) > limits.max_images:
        raise PayloadTooLarge(
            f"the request has {len(parts)} images; max_images is {limits.max_images}",
            param="messages",
            code="too_many_images",
        )
    proj = spec.projector
    per_image = proj.image_tokens if proj is not None else 0
    if len(parts) * per_image >= max_ctx:
        raise ContextOverflow(
            f"{len(parts)} images are {len(parts) * per_image} tokens for {spec.id} "
            f"({per_image} each); the largest context it can get is {max_ctx} ({why}). "
            "Send fewer images or raise the context (--ctx / max_ctx).",
            details={"image_tokens": len(parts) * per_image, "n_ctx": max_ctx},
        )
    decoded = 0
    for i, j, part in parts:
        param = f"messages[{i}].content[{j}].image_url.url"
        spot = part.image_url or {}
        url = spot.get("url")
        if not isinstance(url, str) or not url:
            raise BadRequest("an image_url part needs image_url.url", param=param)
        if remote_allowed(url, limits, param):
            data = await fetch(url, limits, param)
            encoded = base64.b64encode(data).decode("ascii")
        else:
            data, encoded = decode_data_url(url, limits, param)
        checked = inspect(data, limits, param)
        decoded += checked.width * checked.height * DECODED_BYTES_PER_PIXEL
        if decoded > limits.max_decoded:
            raise PayloadTooLarge(
                f"the request's images decode to {format_size(decoded)} (width x height x "
                f"{DECODED_BYTES_PER_PIXEL} each); max_decoded_image_bytes is "
                f"{format_size(limits.max_decoded)}: send fewer or smaller images",
                param=param,
                code="image_too_large",
            )
        # The engine gets exactly what was checked: a data: URL with the format found (it
        # would fetch an http URL itself, and it reads the media type from the prefix).
        spot["url"] = checked.data_url_prefix + encoded
    return len(parts)


async def check_chat_images(services: Any, body: Any) -> int:
    """The chat route's image check (before the model is loaded): only for a vision model;
    a text model's image parts are refused by the route's part check."""
    if not any(getattr(m, "has_images", lambda: False)() for m in body.messages):
        return 0
    spec: ModelSpec = services.catalog.get(body.model or services.settings.default_model)
    if spec.gguf is None:
        return 0  # not an LLM: the route says so
    if not spec.vision:
        i, j = next(
            (i, j)
            for i, m in enumerate(body.messages)
            for j, p in enumerate(m.content if isinstance(m.content, list) else ())
            if p.type == "image_url"
        )
        raise BadRequest(
            f"The model {spec.id!r} has no vision: images (image_url parts, Ollama's images) "
            "need a vision model, an LLM with its mmproj projector (docs/models.md#vision). "
            "GET /v1/models lists each model's capabilities. Send the text only, or choose a "
            "vision model.",
            param=f"messages[{i}].content[{j}].type",
            code="model_not_supported",
        )
    from elbowroom.server.http.limits import context_ceiling

    max_ctx, why = context_ceiling(spec.gguf, services.settings)
    return await check_images(body.messages, spec, services.settings, max_ctx, why)
