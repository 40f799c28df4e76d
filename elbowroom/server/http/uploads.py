"""Receive a multipart/form-data upload without ever holding the file in memory.

Starlette's own form parser accepts a file of any size (spooling it to disk) before the
route runs. Here the Content-Length is checked first, so an oversized upload is refused
before a byte of it is read; then the body is parsed as it streams in, the file part goes
straight to a temporary file, and parsing stops with 413 the moment the file passes the
limit. Text fields are small and capped. The temporary file is removed when the ``async
with`` block ends, whatever happens inside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from fastapi import Request
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from elbowroom.errors import BadRequest, PayloadTooLarge, RequestTimeout
from elbowroom.units import format_size

# Room for the text fields and the part headers on top of the file itself.
FORM_OVERHEAD = 64 * 1024
MAX_FIELD_BYTES = 16 * 1024
MAX_PARTS = 32


@dataclass(frozen=True, slots=True)
class UploadedFile:
    path: Path
    filename: str
    content_type: str
    size: int


@dataclass(frozen=True, slots=True)
class Form:
    fields: dict[str, list[str]]
    file: UploadedFile | None

    def get(self, name: str) -> str | None:
        values = self.fields.get(name)
        return values[-1] if values else None

    def get_all(self, name: str) -> list[str]:
        return self.fields.get(name, [])


@dataclass(slots=True)
class _Part:
    headers: dict[str, str] = field(default_factory=dict)
    name: str = ""
    filename: str | None = None
    data: bytearray = field(default_factory=bytearray)


class _Collector:
    """The parser's callbacks: route the file part to disk, text fields to memory."""

    def __init__(self, file_field: str, max_file: int, directory: str | None) -> None:
        self.file_field = file_field
        self.max_file = max_file
        self.directory = directory
        self.fields: dict[str, list[str]] = {}
        self.file: UploadedFile | None = None
        self.path: Path | None = None
        self._sink: IO[bytes] | None = None
        self._size = 0
        self._parts = 0
        self._part = _Part()
        self._header_field = bytearray()
        self._header_value = bytearray()

    def callbacks(self) -> Any:
        return {
            "on_part_begin": self._on_part_begin,
            "on_header_field": lambda d, s, e: self._header_field.extend(d[s:e]),
            "on_header_value": lambda d, s, e: self._header_value.extend(d[s:e]),
            "on_header_end": self._on_header_end,
            "on_headers_finished": self._on_headers_finished,
            "on_part_data": self._on_part_data,
            "on_part_end": self._on_part_end,
        }

    def _on_part_begin(self) -> None:
        self._parts += 1
        if self._parts > MAX_PARTS:
            raise BadRequest(f"the form has more than {MAX_PARTS} parts")
        self._part = _Part()

    def _on_header_end(self) -> None:
        name = self._header_field.decode("latin-1").strip().lower()
        self._part.headers[name] = self._header_value.decode("latin-1").strip()
        self._header_field.clear()
        self._header_value.clear()

    def _on_headers_finished(self) -> None:
        part = self._part
        _, params = parse_options_header(part.headers.get("content-disposition", ""))
        part.name = params.get(b"name", b"").decode("utf-8", "replace")
        raw_filename = params.get(b"filename")
        part.filename = raw_filename.decode("utf-8", "replace") if raw_filename else None
        if part.name == self.file_field:  # with or without a filename (curl -F file=<x)
            if self._sink is not None:
                raise BadRequest(f"send one {self.file_field!r} part, not several")
            fd, name = tempfile.mkstemp(
                prefix="elbowroom-upload-", suffix=_suffix(part.filename or ""), dir=self.directory
            )
            self.path = Path(name)
            self._sink = os.fdopen(fd, "wb")

    def _on_part_data(self, data: bytes, start: int, end: int) -> None:
        part = self._part
        if part.name == self.file_field and self._sink:
            self._size += end - start
            if self._size > self.max_file:
                raise _too_large(self.max_file)
            self._sink.write(data[start:end])
        else:
            part.data.extend(data[start:end])
            if len(part.data) > MAX_FIELD_BYTES:
                raise BadRequest(
                    f"form field {part.name!r} is longer than {format_size(MAX_FIELD_BYTES)}",
                    param=part.name or None,
                )

    def _on_part_end(self) -> None:
        part = self._part
        if part.name == self.file_field and self._sink:
            self._sink.close()
            assert self.path is not None
            self.file = UploadedFile(
                self.path,
                part.filename or "",
                part.headers.get("content-type", "application/octet-stream"),
                self._size,
            )
        elif part.name:
            text = part.data.decode("utf-8", "replace")
            self.fields.setdefault(part.name, []).append(text)

    def discard(self) -> None:
        if self._sink is not None:
            self._sink.close()
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def _suffix(filename: str) -> str:
    # The extension helps FFmpeg probe the format; keep it short and harmless.
    ext = os.path.splitext(filename)[1].lower()
    return ext if re.fullmatch(r"\.[a-z0-9]{1,8}", ext) else ""


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"the uploaded file is larger than the limit of {format_size(limit)} "
        "(ELBOWROOM_MAX_UPLOAD)",
        param="file",
        code="file_too_large",
    )


@contextlib.asynccontextmanager
async def receive_form(
    request: Request,
    *,
    max_file: int,
    file_field: str = "file",
    directory: str | None = None,
    timeout: float | None = None,
) -> AsyncIterator[Form]:
    """Parse the request's multipart body; the file part (``file_field``) lands on disk.
    ``timeout``: seconds without a byte of the body before a 408 (``body_timeout``)."""
    content_type, params = parse_options_header(request.headers.get("content-type", ""))
    boundary = params.get(b"boundary")
    if content_type != b"multipart/form-data" or not boundary:
        raise BadRequest("send the request as multipart/form-data with a 'file' part")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_file + FORM_OVERHEAD:
        raise _too_large(max_file)
    collector = _Collector(file_field, max_file, directory)
    try:
        parser = MultipartParser(boundary, collector.callbacks())
        try:
            chunks = request.stream()
            while True:
                try:
                    chunk = await asyncio.wait_for(anext(chunks), timeout)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    raise RequestTimeout(
                        f"The upload stopped arriving: nothing for {timeout:g} s (body_timeout)",
                        code="body_timeout",
                    ) from None
                parser.write(chunk)
            parser.finalize()
        except MultipartParseError as exc:
            raise BadRequest(f"the multipart/form-data body is malformed: {exc}") from exc
        if collector.file is None and collector.path is not None:
            raise BadRequest("the upload ended before the file part did", param=file_field)
        yield Form(collector.fields, collector.file)
    finally:
        collector.discard()
