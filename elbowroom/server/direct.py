"""Direct streams: the server reads an LLM's token stream straight from its engine.

The usual path carries every token from the engine, through the runner process's Python
callback, a queue, a pickle and the runner pipe, to the server, which then builds the SSE
event. On a small machine that work competes with the engine's own threads for the same
cores, once per token. A streamed chat or completion that needs no rewriting on the way
(no emulated tools, no transcript fallback, no logprobs) instead goes like this:

1. The runner prepares it (``open`` with the route's ``TextRequest``: slot choice, KV
   disk-tier restore, llama.cpp's request) and answers with the engine's private Unix
   socket, its key and that request: the runner's pressure check ran as usual.
2. The server sends that request to the engine's socket itself and relays the engine's
   OpenAI-shaped SSE events to the client nearly byte for byte: the ``model`` field gets
   elbowroom's id, the usage event gets ``cached_tokens`` rounded down to whole cache
   blocks (exact counts would leak other clients' prompt prefixes) and loses the engine's
   ``timings``; without ``stream_options.include_usage`` the usage is dropped.
3. However it ends (done, client gone, error, pressure) the connection is closed — the
   engine cancels a generation whose reader left — and the runner is told (``close``) to
   give the slot back.

Hard memory pressure aborts a direct stream as it aborts one in the runner: the runner's
pressure watcher closes the engine connection and the client gets a ``memory_pressure``
error event. Errors before the first token (a prompt over the context, a bad schema)
keep their HTTP status: the engine's answer is read before the response starts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from typing import Any, Protocol, runtime_checkable

import anyio

from elbowroom.engines.llama import resumable, translate_error
from elbowroom.engines.requests import DirectClose, Payload, TextRequest
from elbowroom.errors import ElbowroomError, EngineError, MemoryPressure, RunnerCrashed
from elbowroom.memory.types import Pressure
from elbowroom.server.errors import public_error
from elbowroom.server.metrics import record_tokens
from elbowroom.server.model_calls import answer
from elbowroom.server.resume import Resume
from elbowroom.server.sse import DONE, sse

log = logging.getLogger("elbowroom.server")

READ = 64 * 1024
MAX_HEAD = 64 * 1024  # bytes of response head (status line + headers) accepted from the engine
MAX_ERROR_BODY = 1 << 20
EXIT_WAIT = 2.0  # seconds a broken engine connection waits to learn whether the runner died
_MODEL = re.compile(rb'"model":"(?:[^"\\]|\\.)*"')


@runtime_checkable
class DirectRunner(Protocol):
    """A runner whose engine socket this process can reach (runtime/supervisor.py)."""

    direct_streams: bool

    def request(self, kind: str, payload: Payload) -> AsyncIterator[dict[str, Any]]: ...

    def watch_pressure(self, watcher: Callable[[int], None]) -> Callable[[], None]: ...

    async def exit_within(self, timeout: float) -> str | None: ...


async def open_direct(
    runner: Any, stack: AsyncExitStack, model: str, request: TextRequest, include_usage: bool
) -> DirectStream | None:
    """The client's SSE body read straight from the engine, or None when this runner or
    this request needs the runner's own path. ``stack`` holds the scheduler's claim on the
    runner; the returned stream closes it when it ends (on failure here it is left to the
    caller)."""
    if not isinstance(runner, DirectRunner) or not runner.direct_streams:
        return None
    ticket = await answer(runner, "open", request)
    if not ticket.get("direct"):
        return None
    direct = DirectStream(runner, model, ticket, include_usage, stack)
    stack.push_async_callback(direct.close_ticket)
    await direct.connect(request.stream)
    stack.callback(direct.disconnect)
    stack.callback(runner.watch_pressure(direct.on_pressure))
    watch_notices = getattr(runner, "watch_notices", None)
    if watch_notices is not None and resumable(request):  # server/resume.py
        direct.resume = Resume(request)
        stack.callback(watch_notices(direct.on_notice))
    return direct


class DirectStream:
    """The SSE body of one direct stream. Iterate it once; ``release`` (idempotent) gives
    everything back even when the body was never iterated (a client gone before the first
    byte)."""

    def __init__(
        self,
        runner: DirectRunner,
        model: str,
        ticket: dict[str, Any],
        include_usage: bool,
        stack: AsyncExitStack,
    ) -> None:
        self.runner = runner
        self.stack: AsyncExitStack | None = stack
        self.model = model
        self.ticket = ticket
        self.include_usage = include_usage
        self.block = max(1, int(ticket.get("block_tokens") or 1))
        self.model_field = b'"model":' + json.dumps(model).encode()
        self.engine_model: bytes | None = None  # the engine's own "model" field, once seen
        self.reader: asyncio.StreamReader | None = None
        self.headers: dict[str, str] = {}
        self.writer: asyncio.StreamWriter | None = None
        self.timings: dict[str, Any] | None = None
        self.aborted: str | None = None
        self.tokens = 0
        self.finished = False
        self.resume: Resume | None = None  # a resumable stream's state (server/resume.py)

    # ---- the engine connection ---------------------------------------------------------

    async def connect(self, stream: bool = True) -> None:
        body = json.dumps(self.ticket["body"], separators=(",", ":")).encode()
        try:
            self.reader, self.writer = await asyncio.open_unix_connection(
                self.ticket["socket"], limit=MAX_HEAD
            )
            self.writer.write(
                (
                    f"POST {self.ticket['path']} HTTP/1.1\r\nHost: engine\r\n"
                    f"Authorization: Bearer {self.ticket['key']}\r\n"
                    "Content-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                ).encode()
                + body
            )
        except OSError as exc:
            raise await self._lost(exc) from exc
        if stream:  # the first token is there before the response starts
            await self._start(stream)

    async def _start(self, stream: bool) -> None:
        """The engine's response head: a refusal raises (with its status), a stream must be
        chunked. A non-streamed request's head comes with its whole answer."""
        try:
            status, headers = await self._head()
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            raise await self._lost(exc) from exc
        if status != 200:
            raise await self._refusal(status, headers)
        self.headers = headers
        if stream and "chunked" not in headers.get("transfer-encoding", ""):
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

    async def answer(self) -> dict[str, Any]:
        """A non-streamed request's whole answer, rewritten as a stream's usage event is;
        everything is given back before it returns (or raises)."""
        failure: BaseException | None = None
        try:
            await self._start(stream=False)
            data = await self._read_body()
            chunk = json.loads(data)
            if not isinstance(chunk, dict):
                raise EngineError(f"the engine answered {data[:200]!r}")
            if "error" in chunk:
                err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk}
                raise translate_error(err)
            self._account(chunk)
            chunk["model"] = self.model
            for choice in chunk.get("choices") or ():
                # OpenAI's shape (docs/api.md) has both, null when there is nothing to say;
                # some clients read them unconditionally.
                choice.setdefault("logprobs", None)
                if isinstance(choice.get("message"), dict):
                    choice["message"].setdefault("refusal", None)
            return chunk
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            failure = await self._lost(exc)
            raise failure from exc
        except BaseException as exc:
            failure = exc
            raise
        finally:
            await self.release(failure)

    async def _read_body(self) -> bytes:
        assert self.reader is not None
        if "chunked" not in self.headers.get("transfer-encoding", ""):
            return await self.reader.readexactly(int(self.headers.get("content-length", "0")))
        parts = []
        while size := int((await self.reader.readline()).split(b";", 1)[0], 16):
            parts.append((await self.reader.readexactly(size + 2))[:-2])
        return b"".join(parts)

    def disconnect(self) -> None:
        """Close the engine connection: a generation whose reader left is cancelled."""
        if self.writer is not None:
            self.writer.transport.abort()

    async def close_ticket(self, resume: bool = False) -> None:
        """Give the slot back (and the prefill timing to the cache's cost model); ``resume``:
        preempted, its state is saved first for the continuation (server/resume.py)."""
        with anyio.CancelScope(shield=True):
            try:
                closing = DirectClose(self.ticket["ticket"], self.timings, resume)
                await answer(self.runner, "close", closing)
            except ElbowroomError as exc:  # the runner is gone: its slots went with it
                log.debug("closing direct stream %s: %s", self.ticket.get("ticket"), exc)

    def on_pressure(self, level: int) -> None:
        if level >= Pressure.HARD and not self.finished and self.aborted is None:
            self.aborted = "pressure"
            self.disconnect()

    def on_notice(self, data: dict[str, Any]) -> None:
        """The engine preempts this stream (server/resume.py): end the engine connection;
        the relay resumes when its read breaks."""
        resume = self.resume
        if (
            resume is not None
            and data.get("preempt") == self.ticket.get("ticket")
            and not self.finished
            and not resume.preempted
        ):
            resume.preempt()
            self.disconnect()

    async def _resumed(self) -> asyncio.StreamReader:
        """Give the preempted ticket back (its slot goes to the request that needs its
        prefix) and open the continuation on another slot: its reader."""
        assert self.resume is not None
        preempted = int(self.ticket["ticket"])
        await self.close_ticket(resume=True)  # the slot's state is saved, the slot given away
        continuation = self.resume.continuation(preempted)
        ticket = await answer(self.runner, "open", continuation)
        if not ticket.get("direct"):
            raise EngineError("the preempted stream's continuation was not a direct stream")
        self.ticket = ticket
        self.engine_model = None
        await self.connect(True)
        log.info(
            "resumed a preempted stream on %s after %d tokens (slot %s): stalled %.2f s",
            self.model,
            self.resume.produced,
            ticket["body"].get("id_slot"),
            time.monotonic() - self.resume.preempted_at,
        )
        assert self.reader is not None
        return self.reader

    async def _lost(self, exc: BaseException | None) -> ElbowroomError:
        """Why the engine connection broke: our pressure abort, the runner's death (its
        process is reaped a moment after its socket closes) or something else."""
        if self.aborted == "pressure":
            return MemoryPressure(
                f"generation aborted: memory pressure is hard (after {self.tokens} tokens); "
                "retry later or free memory",
                code="memory_pressure",
            )
        cause = await self.runner.exit_within(EXIT_WAIT)
        if cause is not None:
            return RunnerCrashed(
                f"runner for {self.model} died ({cause}); the request failed. The next "
                "request starts the model again.",
                code="runner_crashed",
                details={"exit_cause": cause},
            )
        return EngineError(f"the engine's stream broke off: {exc or 'connection closed'}")

    # ---- the client's body -------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._body()

    async def release(self, failure: BaseException | None = None) -> None:
        stack, self.stack = self.stack, None
        self.finished = True
        if stack is None:
            return
        with anyio.CancelScope(shield=True):
            try:
                if failure is None:
                    await stack.aclose()
                else:
                    await stack.__aexit__(type(failure), failure, failure.__traceback__)
            except Exception:
                log.exception("error while releasing a direct stream on %s", self.model)

    async def _body(self) -> AsyncIterator[bytes]:
        failure: BaseException | None = None
        try:
            async for out in self._relay():
                yield out
        except ElbowroomError as err:
            failure = err
            yield sse(public_error(err, f"stream on {self.model}").to_openai())
        except (GeneratorExit, asyncio.CancelledError):
            log.info("client went away mid-stream: cancelled a direct stream on %s", self.model)
            raise
        except Exception as err:
            failure = err
            yield sse(public_error(err, f"stream on {self.model}").to_openai())
        finally:
            await self.release(failure)

    async def _relay(self) -> AsyncIterator[bytes]:
        """The engine's chunked SSE body, event-aligned and rewritten, until ``[DONE]``."""
        reader = self.reader
        assert reader is not None
        pending = b""
        resume = self.resume
        while True:
            try:
                size_line = await reader.readline()
                size = int(size_line.split(b";", 1)[0], 16)
                chunk = await reader.readexactly(size + 2) if size else b""
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                if resume is not None and resume.preempted and not resume.resumed:
                    reader, pending = await self._resumed(), b""
                    continue
                raise await self._lost(exc) from exc
            if not size:
                if resume is not None and resume.preempted and not resume.resumed:
                    reader, pending = await self._resumed(), b""
                    continue
                raise await self._lost(None)  # the body ended without [DONE]
            pending += chunk[:-2]
            end = pending.rfind(b"\n\n")
            if end < 0:
                continue
            events, pending = pending[: end + 2], pending[end + 2 :]
            out, done = self._rewrite(events)
            if resume is not None:
                if resume.resumed:
                    out = resume.splice(out)
                else:
                    resume.record(out)
            if out:
                yield out
            if done:
                return

    def _rewrite(self, events: bytes) -> tuple[bytes, bool]:
        """Whole SSE events from the engine -> the bytes for the client; True at [DONE]."""
        if self.engine_model is None:
            found = _MODEL.search(events)
            if found is not None:
                self.engine_model = found.group(0)
        # Neither key can occur unescaped inside a JSON string: a plain substring test is
        # exact, and the common event (one token) takes the fast path.
        if b'"usage"' not in events and b'"error"' not in events and b"[DONE]" not in events:
            self.tokens += events.count(b"data: ")
            return self._renamed(events), False
        out = []
        done = False
        for event in events.split(b"\n\n"):
            if not event.startswith(b"data: "):
                continue
            data = event[6:]
            if data == b"[DONE]":
                out.append(DONE)
                done = True
                break
            if b'"usage"' in data or b'"error"' in data:
                rewritten = self._special(data)
                if rewritten is not None:
                    out.append(rewritten)
                continue
            self.tokens += 1
            out.append(self._renamed(data).join((b"data: ", b"\n\n")))
        return b"".join(out), done

    def _account(self, chunk: dict[str, Any]) -> None:
        """Take the engine's timings out of ``chunk`` (for the cost model), round its
        cached_tokens down to whole blocks and count its tokens."""
        timings = chunk.pop("timings", None)
        if isinstance(timings, dict):
            self.timings = {
                k: timings[k]
                for k in ("cache_n", "prompt_n", "prompt_ms", "predicted_n", "predicted_ms")
                if k in timings
            }
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            if self.resume is not None:
                self.resume.fix_usage(usage)
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and "cached_tokens" in details:
                cached = int(details["cached_tokens"])
                details["cached_tokens"] = cached - cached % self.block
            record_tokens(self.model, usage)

    def _renamed(self, data: bytes) -> bytes:
        if self.engine_model is None:
            return data
        return data.replace(self.engine_model, self.model_field)

    def _special(self, data: bytes) -> bytes | None:
        chunk = json.loads(data)
        if "error" in chunk:
            err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk}
            raise translate_error(err)
        self._account(chunk)
        if not self.include_usage:
            chunk.pop("usage", None)
        if "model" in chunk:
            chunk["model"] = self.model
        if not chunk.get("choices") and "usage" not in chunk:
            return None  # the usage-only event of a client that did not ask for usage
        return sse(chunk)
