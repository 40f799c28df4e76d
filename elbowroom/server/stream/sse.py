"""Server-sent events, a streamed response that always ends what it holds, and a
non-streamed answer awaited while the client may leave.

``ManagedStream`` closes its body iterator when the response ends for any reason: on a
client disconnect Starlette abandons the iterator, and closing it (and its ``release``) is
what ends the request (server/stream/relay.py ``Relay.release``: the engine stops generating).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

log = logging.getLogger("elbowroom.server")

DONE = b"data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class ClientGone(Exception):
    """The client closed the connection before its non-streamed answer was ready."""


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect (it never comes
    # while the client waits).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work`` (collecting a non-streamed answer); if the client disconnects first,
    cancel it and raise ClientGone. A non-streamed generation is cancelled like a stream's
    (``Relay.release`` closes the engine connection)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone


def gone_response() -> Response:
    """What a handler returns for a client that left: nobody reads it (nginx's 499)."""
    return Response(status_code=499)


async def _aclose(iterator: AsyncIterator[Any]) -> None:
    close = getattr(iterator, "aclose", None)
    if close is not None:
        await close()


class ManagedStream(StreamingResponse):
    """An SSE response whose body iterator is always closed, even after a disconnect."""

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[bytes] | AsyncIterable[bytes],
        release: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        if not isinstance(content, AsyncIterator):
            content = aiter(content)
        super().__init__(
            content,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._content = content
        # Closing a body iterator that never started runs none of its code: what it holds
        # is given back by ``release`` too (idempotent), e.g. for a client gone before the
        # first byte.
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await _aclose(self._content)
                if self._release is not None:
                    await self._release()
