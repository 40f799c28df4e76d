"""One LLM request's events, read from its engine: ``open`` on the runner, then llama.cpp's
own OpenAI-shaped SSE events, and the slot given back however it ends.

``text_events(runner, request)`` is an async generator. Its first item is the engine's
``TextTicket`` (what to rewrite on the way); every later item is ``bytes`` holding whole SSE
events (``data: {...}\\n\\n``), the last ones the usage event and ``data: [DONE]``. Where the
events come from is the ticket's to say:

- ``ticket.socket`` set (llama.cpp, in a runner of this host): this process posts the
  ticket's body to the engine's private Unix socket and reads the chunked SSE body itself,
  so no token crosses the runner pipe. The engine cancels a generation whose reader left;
  hard memory pressure (the runner's pressure watcher) closes the connection the same way.
  Errors before the first event (a prompt over the context, a bad schema) keep their HTTP
  status: the engine's response head is read before the first item after the ticket.
- ``ticket.socket`` None (MLX, which has no HTTP server; a node's runner, whose agent runs
  this same function there): the events follow over the runner's request as
  ``{"type": "events", "data": bytes}`` items.

Closing the generator (``aclose``; the relay always does) ends everything: the engine
connection or the runner request, then ``close`` gives the slot back (shielded). The
engine's prefill timings ride on that ``close`` to the cache's cost model.

``preemptible`` (a resumable stream, server/stream/resume.py): the runner's notice
``{"preempt": ticket}`` closes the engine connection, ``close`` asks the engine to save the
slot's state first (``CloseTicket.resume``), and the generator raises ``Preempted``; the
relay then opens the continuation (server/stream/relay.py ``Relay._blocks``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Protocol, cast

import anyio

from elbowroom.engines.llama import translate_error
from elbowroom.engines.requests import CloseTicket, Payload, TextRequest, TextTicket
from elbowroom.errors import ElbowroomError, EngineError, MemoryPressure, RunnerCrashed
from elbowroom.memory.types import Pressure

log = logging.getLogger("elbowroom.runtime")

MAX_HEAD = 64 * 1024  # bytes of response head (status line + headers) accepted from the engine
MAX_ERROR_BODY = 1 << 20
EXIT_WAIT = 2.0  # seconds a broken engine connection waits to learn whether the runner died
_TIMINGS = re.compile(rb'"timings":(\{[^{}]*\})')
TIMING_KEYS = ("cache_n", "prompt_n", "prompt_ms", "predicted_n", "predicted_ms")


class Preempted(EngineError):
    """The engine took this stream's slot for a request that needs its prefix; its state is
    saved for the continuation (server/stream/resume.py)."""

    def __init__(self, ticket: int, at: float, cached: int | None = None) -> None:
        super().__init__(f"ticket {ticket} was preempted")
        self.ticket = ticket
        self.at = at  # time.monotonic() of the runner's notice
        self.cached = cached  # prompt tokens the engine reused for it (None: not told)


class TextRunner(Protocol):
    """What ``text_events`` needs of a runner (runtime/protocol.py ``Runner``)."""

    @property
    def spec(self) -> Any: ...

    def request(self, kind: str, payload: Payload) -> AsyncIterator[dict[str, Any]]: ...


class SocketHost(TextRunner, Protocol):
    """A runner whose engine socket is on this host (runtime/supervisor.py)."""

    def watch_pressure(self, watcher: Callable[[int], None]) -> Callable[[], None]: ...

    async def exit_within(self, timeout: float) -> str | None: ...


async def text_events(
    runner: TextRunner, request: TextRequest, *, preemptible: bool = False
) -> AsyncGenerator[TextTicket | bytes, None]:
    items = runner.request("open", request)
    try:
        first = await anext(items)
        ticket = first.get("ticket")
        if not isinstance(ticket, TextTicket):
            raise EngineError(f"the runner answered open with {first!r}")
        if ticket.socket is not None:
            await _aclose(items)  # the ticket was the whole answer: the slot is held
            inner = _from_socket(cast(SocketHost, runner), ticket, preemptible)
            try:
                async for out in inner:
                    yield out
            finally:  # now, not when the collector finds it: the slot goes back here
                with anyio.CancelScope(shield=True):
                    await inner.aclose()
            return
        yield ticket
        async for item in items:
            if item.get("type") == "events":
                yield bytes(item["data"])
            elif item.get("type") == "done":
                return
    finally:
        with anyio.CancelScope(shield=True):
            await _aclose(items)  # a request not answered yet is cancelled in the runner


async def _from_socket(
    runner: SocketHost, ticket: TextTicket, preemptible: bool = False
) -> AsyncGenerator[TextTicket | bytes, None]:
    conn = EngineConnection(runner, ticket)
    unwatch: Callable[[], None] = lambda: None  # noqa: E731
    unnotice: Callable[[], None] = lambda: None  # noqa: E731
    try:
        await conn.connect()
        unwatch = runner.watch_pressure(conn.on_pressure)
        watch_notices = getattr(runner, "watch_notices", None)
        if preemptible and watch_notices is not None:
            unnotice = watch_notices(conn.on_notice)
        yield TextTicket(
            ticket=ticket.ticket,
            socket=None,
            block_tokens=ticket.block_tokens,
            emulated_tools=ticket.emulated_tools,
            transcript=ticket.transcript,
        )
        async for block in conn.events():
            yield block
    finally:
        unwatch()
        unnotice()
        conn.disconnect()
        with anyio.CancelScope(shield=True):
            try:
                resume = conn.aborted == "preempt"  # the engine saves the slot's state first
                await _answer(runner, CloseTicket(ticket.ticket, conn.timings, resume))
            except ElbowroomError as exc:  # the runner is gone: its slots went with it
                log.debug("closing ticket %s: %s", ticket.ticket, exc)


async def _aclose(items: AsyncIterator[Any]) -> None:
    close = getattr(items, "aclose", None)
    if close is not None:
        await close()


async def _answer(runner: TextRunner, payload: CloseTicket) -> None:
    async for item in runner.request("close", payload):
        if item.get("type") == "done":
            return


class EngineConnection:
    """One HTTP/1.1 request on the engine's private socket and its chunked SSE body."""

    def __init__(self, runner: SocketHost, ticket: TextTicket) -> None:
        self.runner = runner
        self.ticket = ticket
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.timings: dict[str, Any] | None = None
        self.aborted: str | None = None
        self.events_seen = 0
        self.finished = False
        self.preempted_at = 0.0
        self.preempted_cached: int | None = None

    async def connect(self) -> None:
        ticket = self.ticket
        assert ticket.socket is not None
        body = json.dumps(ticket.body, separators=(",", ":")).encode()
        try:
            self.reader, self.writer = await asyncio.open_unix_connection(
                ticket.socket, limit=MAX_HEAD
            )
            self.writer.write(
                (
                    f"POST {ticket.path} HTTP/1.1\r\nHost: engine\r\n"
                    f"Authorization: Bearer {ticket.key}\r\n"
                    "Content-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                ).encode()
                + body
            )
            status, headers = await self._head()
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            raise await self._lost(exc) from exc
        if status != 200:
            raise await self._refusal(status, headers)
        if "chunked" not in headers.get("transfer-encoding", ""):
            raise EngineError(f"the engine answered a stream without chunked encoding: {headers}")

    async def _head(self) -> tuple[int, dict[str, str]]:
        assert self.reader is not None
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip().lower()
        return status, headers

    async def _refusal(self, status: int, headers: dict[str, str]) -> ElbowroomError:
        """The engine's error answer (before any token) as elbowroom's error."""
        assert self.reader is not None
        try:
            size = min(int(headers.get("content-length", "0")), MAX_ERROR_BODY)
            err = json.loads(await self.reader.readexactly(size)).get("error") or {}
        except (ValueError, OSError, asyncio.IncompleteReadError, AttributeError):
            err = {}
        if not isinstance(err, dict):
            err = {"message": str(err)}
        return translate_error({"code": status, **err})

    async def events(self) -> AsyncIterator[bytes]:
        """The chunked SSE body as whole events, until ``[DONE]``."""
        reader = self.reader
        assert reader is not None
        pending = b""
        while True:
            try:
                size_line = await reader.readline()
                size = int(size_line.split(b";", 1)[0], 16)
                chunk = await reader.readexactly(size + 2) if size else b""
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                raise await self._lost(exc) from exc
            if not size:
                raise await self._lost(None)  # the body ended without [DONE]
            pending += chunk[:-2]
            end = pending.rfind(b"\n\n")
            if end < 0:
                continue
            block, pending = pending[: end + 2], pending[end + 2 :]
            self.events_seen += block.count(b"data: ")
            if b'"timings"' in block:
                self._take_timings(block)
            yield block
            if block.endswith(b"data: [DONE]\n\n"):
                self.finished = True
                return

    def _take_timings(self, block: bytes) -> None:
        found = _TIMINGS.search(block)
        if found is None:
            return
        try:
            timings = json.loads(found.group(1))
        except ValueError:
            return
        self.timings = {k: timings[k] for k in TIMING_KEYS if k in timings}

    def disconnect(self) -> None:
        """Close the engine connection: a generation whose reader left is cancelled."""
        self.finished = True
        if self.writer is not None:
            self.writer.transport.abort()

    def on_pressure(self, level: int) -> None:
        if level >= Pressure.HARD and not self.finished and self.aborted is None:
            self.aborted = "pressure"
            if self.writer is not None:
                self.writer.transport.abort()

    def on_notice(self, data: dict[str, Any]) -> None:
        """The engine preempts this stream (server/stream/resume.py): end the engine connection;
        the read breaks with ``Preempted``."""
        if data.get("preempt") == self.ticket.ticket and not self.finished and not self.aborted:
            self.aborted = "preempt"
            self.preempted_at = time.monotonic()
            cached = data.get("cached")
            self.preempted_cached = cached if isinstance(cached, int) else None
            log.info("preempt: ending the engine connection of ticket %d", self.ticket.ticket)
            if self.writer is not None:
                self.writer.transport.abort()

    async def _lost(self, exc: BaseException | None) -> ElbowroomError:
        """Why the engine connection broke: our pressure abort, a preemption, the runner's
        death (its process is reaped a moment after its socket closes) or something else."""
        if self.aborted == "preempt":
            return Preempted(self.ticket.ticket, self.preempted_at, self.preempted_cached)
        if self.aborted == "pressure":
            return MemoryPressure(
                f"generation aborted: memory pressure is hard (after {self.events_seen} "
                "tokens); retry later or free memory",
                code="memory_pressure",
            )
        cause = await self.runner.exit_within(EXIT_WAIT)
        if cause is not None:
            model = getattr(self.runner.spec, "id", "the model")
            return RunnerCrashed(
                f"runner for {model} died ({cause}); the request failed. The next "
                "request starts the model again.",
                code="runner_crashed",
                details={"exit_cause": cause},
            )
        return EngineError(f"the engine's stream broke off: {exc or 'connection closed'}")
