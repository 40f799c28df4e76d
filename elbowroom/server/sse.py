"""Server-sent events, and holding a runner for exactly as long as a stream lives.

``open_generation`` takes the model through the scheduler and waits for the runner's first
event *before* any byte is sent, so errors that happen up front (unknown model, 507, queue
full, a prompt over the context) still get their real HTTP status. After that, errors travel
as one ``data: {"error": ...}`` event and the stream ends.

``ManagedStream`` closes its body iterator when the response ends for any reason: on a
client disconnect Starlette abandons the iterator, and closing it is what tells the runner
to stop generating (the runner's request iterator cancels on close).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from elbowroom.errors import ElbowroomError

if TYPE_CHECKING:
    from elbowroom.engines.requests import TextRequest
    from elbowroom.runtime.protocol import Runner
    from elbowroom.server.deps import SchedulerService

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
    cancel it and raise ClientGone. A non-streamed generation is cancelled like a stream's:
    closing the runner's iterator (in ``Generation.release``) stops the engine."""
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


@dataclass(slots=True)
class Generation:
    """A runner held for one request: its first event and the rest of its events."""

    first: dict[str, Any]
    rest: AsyncIterator[dict[str, Any]]
    _stack: AsyncExitStack
    _released: bool = False

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        yield self.first
        async for item in self.rest:
            yield item

    async def release(self, exc: BaseException | None = None) -> None:
        """Close the runner's iterator (cancelling its work), then give the model back to the
        scheduler. Shielded: it runs while the request task is being cancelled. Only the
        first call does anything."""
        if self._released:
            return
        self._released = True
        with anyio.CancelScope(shield=True):
            try:
                if exc is None:
                    await self._stack.aclose()
                else:
                    await self._stack.__aexit__(type(exc), exc, exc.__traceback__)
            except Exception:
                log.exception("error while releasing a runner")


async def hold_runner(
    scheduler: SchedulerService, model: str, keep_alive: float | None
) -> tuple[Runner, AsyncExitStack]:
    """The model's runner, claimed from the scheduler until the returned stack closes."""
    stack = AsyncExitStack()
    runner = await stack.enter_async_context(scheduler.use(model, keep_alive=keep_alive))
    return runner, stack


async def abandon(stack: AsyncExitStack, exc: BaseException) -> None:
    """Give a held runner back after ``exc`` (shielded: it runs while being cancelled)."""
    with anyio.CancelScope(shield=True):
        await stack.__aexit__(type(exc), exc, exc.__traceback__)


async def open_generation(
    scheduler: SchedulerService, model: str, keep_alive: float | None, request: TextRequest
) -> Generation:
    runner, stack = await hold_runner(scheduler, model, keep_alive)
    return await start_generation(runner, stack, request)


async def start_generation(
    runner: Runner, stack: AsyncExitStack, request: TextRequest
) -> Generation:
    """Send the request to the held runner and wait for its first event."""
    try:
        rest = runner.request(request.kind, request)
        stack.push_async_callback(_aclose, rest)
        first = await rest.__anext__()
    except StopAsyncIteration:
        await stack.aclose()
        raise ElbowroomError("the runner ended the request without a result") from None
    except BaseException as exc:
        await abandon(stack, exc)
        raise
    return Generation(first, rest, stack)


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
