"""What the pure ASGI middlewares share: reading headers, answering with an error."""

from __future__ import annotations

import json
from collections.abc import Iterable

from starlette.types import Scope, Send

from elbowroom.errors import ElbowroomError
from elbowroom.server.http.ollama_paths import error_body, is_ollama_path


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of request header ``name`` (lower-case bytes), or None."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value)
    return None


async def send_error(
    scope: Scope, send: Send, err: ElbowroomError, extra: Iterable[tuple[bytes, bytes]] = ()
) -> None:
    """Answer with ``err`` before any route ran: in Ollama's error shape on its paths, in
    OpenAI's everywhere else."""
    ollama = is_ollama_path(scope.get("path", ""))
    body = json.dumps(error_body(err) if ollama else err.to_openai()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *((k.lower().encode(), v.encode()) for k, v in err.headers().items()),
        *extra,
    ]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
