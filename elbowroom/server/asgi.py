"""What the pure ASGI middlewares share: reading headers, answering with an error."""

from __future__ import annotations

import json
from collections.abc import Iterable

from starlette.types import Scope, Send

from elbowroom.errors import ElbowroomError


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of request header ``name`` (lower-case bytes), or None."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value)
    return None


async def send_error(
    send: Send, err: ElbowroomError, extra: Iterable[tuple[bytes, bytes]] = ()
) -> None:
    """Answer with ``err`` in the OpenAI error shape, before any route ran."""
    body = json.dumps(err.to_openai()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *((k.lower().encode(), v.encode()) for k, v in err.headers().items()),
        *extra,
    ]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
